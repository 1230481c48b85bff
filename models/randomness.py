"""Per-sample randomness: σ, noise and caption dropout drawn from (seed, step, sample key, purpose) alone.

Never from a global RNG, so a sample gets the same numbers whichever rank or batch it lands in: 1 and N
processes (and any resume point) train the same LoRA, and evaluate's fixed noise is the same for base and LoRA.

`repeat`: an optimizer step's accumulation micro-batches may run on into the next epoch, so one step can hold a
sample twice (or more, on a tiny split). Its n-th repeat in the step (1, 2, ...) draws under a purpose of its own,
so it is a second sample of the loss, not the first one counted twice; the first occurrence (repeat 0) draws
what it always drew. The repeat count is a function of the step's planned samples, so it too is the same on any
rank count and resume point.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from torch import Tensor

from models.flow import SigmaSettings, sample_sigmas
from models.sample import TrainSample
from schemas.errors import UserError


def sample_generator(seed: int, step: int, key: str, purpose: str, repeat: int = 0) -> torch.Generator:
    """A CPU generator seeded from (seed, step, sample key, purpose) alone (and `repeat`, when not 0)."""
    if repeat:
        purpose = f"{purpose}#{repeat}"
    digest = hashlib.sha256(f"{seed}:{step}:{key}:{purpose}".encode()).digest()
    return torch.Generator("cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def draw_noise(sample: TrainSample, seed: int, step: int, repeat: int = 0) -> Tensor:
    """float32 ε shaped like the sample's target latent ([C, 1, h, w]), on the CPU (same on every device)."""
    g = sample_generator(seed, step, sample.key, "noise", repeat)
    return torch.randn(tuple(sample.target.shape), generator=g, dtype=torch.float32)


def draw_sigma(sample: TrainSample, seed: int, step: int, cfg: SigmaSettings, repeat: int = 0) -> Tensor:
    """[] float32 σ from the configured distribution (dynamic shift uses the sample's own target length)."""
    g = sample_generator(seed, step, sample.key, "sigma", repeat)
    return sample_sigmas(1, cfg, g, [sample.target_tokens])[0]


def draw_caption_dropout(sample: TrainSample, seed: int, step: int, p: float, repeat: int = 0) -> bool:
    if p <= 0:
        return False
    g = sample_generator(seed, step, sample.key, "caption-dropout", repeat)
    return bool(torch.rand((), generator=g) < p)


def draw_control_dropout(sample: TrainSample, seed: int, step: int, p: float, repeat: int = 0) -> bool:
    if p <= 0:
        return False
    g = sample_generator(seed, step, sample.key, "control-dropout", repeat)
    return bool(torch.rand((), generator=g) < p)


def with_control_dropout(samples: list[TrainSample], seed: int, step: int, p: float,
                         repeats: list[int] | None = None) -> list[TrainSample]:
    """Each sample drawn for control dropout conditions on its instruction encoded without the control images
    (`nocontrol_embeds`; the control latents stay in the transformer's input). `repeats`: per sample, see
    the module docstring (None: all 0)."""
    out = []
    for j, s in enumerate(samples):
        if draw_control_dropout(s, seed, step, p, repeats[j] if repeats else 0):
            if s.nocontrol_embeds is None:
                raise UserError(f"train.control_dropout needs the text table's nocontrol_embeds (sample {s.key} has "
                                "none): re-run encode-text with encode_text.no_control_embeds: true")
            if s.slot_mask is not None:  # Qwen-Image-2.1: the layout follows the prompt's slots, so drop the
                # references themselves (the text-to-image prompt); the caption stays (no empty t2i prompt stored)
                no_slots = s.nocontrol_embeds.new_zeros(s.nocontrol_embeds.shape[0], dtype=torch.bool)
                s = dataclasses.replace(s, prompt_embeds=s.nocontrol_embeds, slot_mask=no_slots, controls=[],
                                        img_shapes=s.img_shapes[:1], empty_embeds=s.nocontrol_embeds,
                                        empty_slot_mask=no_slots)
            else:
                s = dataclasses.replace(s, prompt_embeds=s.nocontrol_embeds)
        out.append(s)
    return out


def eval_noise(sample: TrainSample, seed: int) -> Tensor:
    """float32 ε like the target latent, from (seed, key) only: the same for base and LoRA, any batch order."""
    g = sample_generator(seed, 0, sample.key, "eval-noise")
    return torch.randn(tuple(sample.target.shape), generator=g, dtype=torch.float32)
