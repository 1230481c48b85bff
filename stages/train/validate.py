"""Validation while training (`train.validate_every`, `train.sample_every`).

Held-out loss: evaluate's protocol on a fixed, capped subset of the val split (the first
`validate_max_samples` keys in sorted order) x `validate_noise_seeds` x `validate_timesteps`, with the trainer's
own `models.flow.flow_loss` and `models.randomness.eval_noise` (fixed per (seed, key), the same at every
validation) -> TensorBoard `val/loss` (and `val/loss_ema` with an EMA). Samples: the first `sample_count` of those
val samples generated from their stored features (`models.generate`, seed `train.seed`, `sample_steps` Euler
steps, true CFG 4 against the stored empty prompt) -> `RUN/samples/step-N.png` (one row: each sample's output)
and TensorBoard `samples/grid`.

Resume-exact: validation runs in eval mode (no LoRA dropout), under `torch.no_grad` and a forked global RNG,
and never touches the data stream, so a run with validation trains the same LoRA as one without (tested).
Runs on the main process only; the others go on to the next step's all-reduce and wait there.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from models.flow import flow_loss
from models.generate import Conditioning, generate
from models.randomness import eval_noise
from models.sample import TrainSample
from schemas.config import TrainConfig
from schemas.errors import UserError
from schemas.img_shapes import PIXELS_PER_PATCH
from stages.train.data import load, open_inputs

SAMPLE_CFG = 4.0


@contextmanager
def untouched(transformer):
    """Eval mode, no grad, the global RNG states restored afterwards: training continues as if nothing ran."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    was_training = transformer.training
    transformer.eval()
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            yield
    finally:
        transformer.train(was_training)


class Validator:
    def __init__(self, cfg: TrainConfig, store, model: str, run_dir: Path):
        self.cfg, self.model, self.run_dir = cfg, model, run_dir
        tables = open_inputs(store, model, split="val")
        keys = sorted(tables.keys)[: cfg.validate_max_samples]
        if not keys:
            raise UserError(f"train.validate_every / sample_every is set but store {store} has no val samples; "
                            "set resize.val_fraction > 0 or turn validation off")
        self.samples: list[TrainSample] = [load(tables, k) for k in keys]
        self.rows = [(s, seed, float(t)) for s in self.samples for seed in cfg.validate_noise_seeds
                     for t in cfg.validate_timesteps]
        self._vae = self._scheduler = None

    def loss(self, transformer) -> float:
        """Mean over samples x seeds x σ of the per-sample flow loss (rows in batches of train.batch_size)."""
        values: list[float] = []
        bs = self.cfg.batch_size
        for i in range(0, len(self.rows), bs):
            chunk = self.rows[i : i + bs]
            sigmas = torch.tensor([t for _, _, t in chunk], dtype=torch.float32)
            noises = [eval_noise(s, seed) for s, seed, _ in chunk]
            values += flow_loss(transformer, [s for s, _, _ in chunk], sigmas, noises).tolist()
        return sum(values) / len(values)

    def samples_grid(self, transformer) -> Image.Image:
        from models.loading import load_component

        if self._vae is None:
            self._vae = load_component(self.model, "vae", dtype=torch.float32, device=transformer.device)
            self._scheduler = dict(load_component(self.model, "scheduler").config)
        images = []
        for s in tqdm(self.samples[: self.cfg.sample_count], desc="samples", leave=False):
            _, h, w = s.img_shapes[0]
            if s.slot_mask is not None:  # Qwen-Image-2.1 (models/qwen21_generate.py), RGB for the grid
                images.append(self._sample_21(transformer, s, h, w))
                continue
            dev, dt = transformer.device, transformer.dtype
            cond = Conditioning(prompt_embeds=s.prompt_embeds.to(dev, dt)[None],
                                control_latents=[c.to(dev, dt)[None] for c in s.controls],
                                negative_embeds=s.empty_embeds.to(dev, dt)[None])
            images.append(generate(transformer, self._vae, self._scheduler, cond, h * PIXELS_PER_PATCH,
                                   w * PIXELS_PER_PATCH, self.cfg.sample_steps, SAMPLE_CFG, self.cfg.seed))
        grid = Image.new("RGB", (sum(im.width for im in images), max(im.height for im in images)))
        x = 0
        for im in images:
            grid.paste(im, (x, 0))
            x += im.width
        return grid

    def _sample_21(self, transformer, s: TrainSample, h: int, w: int) -> Image.Image:
        from diffusers import FlowMatchEulerDiscreteScheduler

        from models.qwen21_generate import generate_21

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self._scheduler)
        return generate_21(transformer, self._vae, scheduler, s.prompt_embeds, s.slot_mask, list(s.controls), h * 16,
                           w * 16, self.cfg.sample_steps, self.cfg.seed, SAMPLE_CFG,
                           (s.empty_embeds, s.empty_slot_mask)).convert("RGB")

    def __call__(self, r) -> None:
        """At the configured steps: log the held-out loss (and the EMA's), write the sample grid."""
        cfg, step = self.cfg, r.step
        do_loss = cfg.validate_every is not None and step % cfg.validate_every == 0
        do_samples = cfg.sample_every is not None and step % cfg.sample_every == 0
        if not (do_loss or do_samples) or not r.main:
            return
        with untouched(r.transformer):
            if do_loss:
                loss = self.loss(r.transformer)
                r.writer.add_scalar("val/loss", loss, step)
                r.bar.write(f"step {step}: val loss {loss:.4f} ({len(self.samples)} samples)")
                if r.ema is not None:
                    with r.ema.swapped_in():
                        r.writer.add_scalar("val/loss_ema", self.loss(r.transformer), step)
            if do_samples:
                grid = self.samples_grid(r.transformer)
                out = self.run_dir / "samples"
                out.mkdir(parents=True, exist_ok=True)
                grid.save(out / f"step-{step:06d}.png")
                r.writer.add_image("samples/grid", np.asarray(grid), step, dataformats="HWC")
