"""Per-sample randomness: σ, noise and caption dropout drawn from (seed, step, sample key, purpose) alone.

Never from a global RNG, so a sample gets the same numbers whichever rank or batch it lands in: 1 and N
processes (and any resume point) train the same LoRA, and evaluate's fixed noise is the same for base and LoRA.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
from torch import Tensor

from models.flow import SigmaSettings, sample_sigmas
from models.sample import TrainSample
from schemas.errors import UserError


def sample_generator(seed: int, step: int, key: str, purpose: str) -> torch.Generator:
    """A CPU generator seeded from (seed, step, sample key, purpose) alone."""
    digest = hashlib.sha256(f"{seed}:{step}:{key}:{purpose}".encode()).digest()
    return torch.Generator("cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def draw_noise(sample: TrainSample, seed: int, step: int) -> Tensor:
    """float32 ε shaped like the sample's target latent ([C, 1, h, w]), on the CPU (same on every device)."""
    g = sample_generator(seed, step, sample.key, "noise")
    return torch.randn(tuple(sample.target.shape), generator=g, dtype=torch.float32)


def draw_sigma(sample: TrainSample, seed: int, step: int, cfg: SigmaSettings) -> Tensor:
    """[] float32 σ from the configured distribution (dynamic shift uses the sample's own target length)."""
    g = sample_generator(seed, step, sample.key, "sigma")
    return sample_sigmas(1, cfg, g, [sample.target_tokens])[0]


def draw_caption_dropout(sample: TrainSample, seed: int, step: int, p: float) -> bool:
    if p <= 0:
        return False
    g = sample_generator(seed, step, sample.key, "caption-dropout")
    return bool(torch.rand((), generator=g) < p)


def draw_control_dropout(sample: TrainSample, seed: int, step: int, p: float) -> bool:
    if p <= 0:
        return False
    g = sample_generator(seed, step, sample.key, "control-dropout")
    return bool(torch.rand((), generator=g) < p)


def with_control_dropout(samples: list[TrainSample], seed: int, step: int, p: float) -> list[TrainSample]:
    """Each sample drawn for control dropout conditions on its instruction encoded without the control images
    (`nocontrol_embeds`; the control latents stay in the transformer's input)."""
    out = []
    for s in samples:
        if draw_control_dropout(s, seed, step, p):
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
