"""Qwen-Image-2.1 prompt encoding: exactly what `QwenImage21Pipeline` feeds its transformer, one sample at a time.

The stock `_get_qwen_prompt_embeds` is called on a pipeline instance that holds only the text encoder and the
processor (no transformer, no VAE): same raw template ("Picture"-less `<imageN>` slots, one per reference),
the same RGBA-over-white composite for the VLM, the same forward hook that keeps the last decoder layer's output
before the final norm, the same system-token drop. Reusing the upstream code rather than a copy means the
stored features follow diffusers exactly (the equivalence test compares with a full pipeline's encode_prompt).

A sample is encoded alone (batch 1): the stock function takes one image set for all prompts of a call.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

# One VLM slot (patch 16 x merge 2) covers 32 x 32 pixels = 2 x 2 latent tokens of the 16x VAE.
PIXELS_PER_SLOT = 32


def prompt_encoder(text_encoder, processor):
    """A `QwenImage21Pipeline` holding only the text encoder and processor (nothing else is loaded)."""
    from diffusers import QwenImage21Pipeline

    return QwenImage21Pipeline(scheduler=None, vae=None, text_encoder=text_encoder, processor=processor,
                               transformer=None)


@torch.no_grad()
def encode_prompt(encoder, caption: str, references: list) -> tuple[Tensor, Tensor]:
    """(hidden states [L, D], image-slot mask [L] bool) of one prompt with its references (PIL, in order) as
    the stock pipeline computes them for the transformer (valid tokens only: one prompt has no padding)."""
    device = encoder.text_encoder.device
    embeds, mask, slots = encoder._get_qwen_prompt_embeds([caption], references or None, device)
    valid = mask[0].bool()
    return embeds[0][valid], slots[0][valid].bool()


def slot_runs(slot_mask: Tensor) -> list[int]:
    """Lengths of the runs of image slots, in order (one run per reference: the template separates them)."""
    runs, n = [], 0
    for v in slot_mask.tolist() + [False]:
        if v:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def grid_mismatch(slot_mask: Tensor, sizes: list[tuple[int, int]]) -> str | None:
    """Why the VLM grid differs from the VAE grid (each reference's slots must be its (H/32) x (W/32)), or None.
    sizes: (height, width) in pixels of each reference."""
    want = [(h // PIXELS_PER_SLOT) * (w // PIXELS_PER_SLOT) for h, w in sizes]
    got = slot_runs(slot_mask)
    if got != want:
        return (f"the VLM gave {got} image slots for references of {want} (2x2-latent) slots: the processor resized "
                "an image (check its min/max pixels) or a side is not a multiple of 32")
    return None


@lru_cache(maxsize=1)
def frame_positions() -> int:
    """How many frame-axis positions diffusers' `QwenImage21Rope` has: read from an instance (its leading rows
    equal to the frequencies of 0, 1, 2, ...; the rows after them are its negative positions)."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Rope

    rope = QwenImage21Rope(theta=10000, axes_dim=[2, 2, 2])
    table = rope.freqs[0][:, 0]
    counting = rope.rope_params(torch.arange(len(table)), 2, 10000)[:, 0]
    return int((table != counting).nonzero()[0]) if bool((table != counting).any()) else len(table)


def target_frame_position(text_tokens: int, reference_latents: list[tuple[int, int]]) -> int:
    """The frame position the stock RoPE gives the target block: each text token takes one, each reference block
    is frozen at the position reached and advances it by its max(h, w) (latent tokens), and the target comes
    last. It must be below `frame_positions()`."""
    return text_tokens + sum(max(h, w) for h, w in reference_latents)
