"""EMA of the adapter (`train.ema_decay`): ema ← d·ema + (1 − d)·θ after every optimizer step n, with a
warm-up: d = min(ema_decay, n / (n + 9)) from step 2 on, 0 at step 1 (the EMA starts at the first step's adapter).

The warm-up is diffusers' `EMAModel` default (`get_decay` without `use_ema_warmup`): a fixed decay from the
init LoRA (B = 0, a zero delta) left a run of 1000 steps at 0.999 with 37 % of its EMA the untrained init. The
step is the optimizer step (`Run.step`, restored on a resume), so a resumed run's EMA is a straight run's bit for bit.

float32 copies of the trainable adapter tensors, in `lora_parameters` order. Saved into each checkpoint
(`ema.safetensors`, `models.ema_file`: resumed exactly, scored by evaluate --all-checkpoints) and, at the end, as
a LoRA of its own in the diffusers format (`RUN/lora_ema`, written through the same `save_lora` by swapping the
EMA values in for the save), so evaluate, predict, merge and diffusers read it like `RUN/lora`.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from models.ema_file import EMA_FILE, read_values, save_values
from schemas.errors import UserError


class AdapterEMA:
    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params, self.decay = params, decay
        self.shadow = [p.detach().float().clone() for p in params]

    def decay_at(self, step: int) -> float:
        """The decay of the update after optimizer step `step` (1-based): diffusers' `EMAModel.get_decay`."""
        return 0.0 if step <= 1 else min(self.decay, step / (9 + step))

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step` (1-based)."""
        weight = 1.0 - self.decay_at(step)
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().float(), weight)

    @contextmanager
    @torch.no_grad()
    def swapped_in(self):
        """The adapter holds the EMA values inside the block, its own values again after it."""
        saved = [p.detach().clone() for p in self.params]
        for p, s in zip(self.params, self.shadow):
            p.copy_(s)
        try:
            yield
        finally:
            for p, v in zip(self.params, saved):
                p.copy_(v)

    def save(self, folder: Path) -> None:
        save_values(self.shadow, folder)

    def load(self, folder: Path, kept: dict[str, bytes] | None = None) -> None:
        """`kept`: the checkpoint's bytes its check read (stages.train.state.kept_bytes)."""
        from stages.train.state import kept_bytes

        path = folder / EMA_FILE
        if not (kept and EMA_FILE in kept) and not path.is_file():
            raise UserError(f"{folder} has no {EMA_FILE}: it was written without train.ema_decay")
        saved = read_values(kept_bytes(folder, EMA_FILE, kept))
        if len(saved) != len(self.shadow):
            raise UserError(f"{path}: EMA of {len(saved)} tensors, the adapter has {len(self.shadow)}")
        self.shadow = [v.to(s.device) for v, s in zip(saved, self.shadow)]
