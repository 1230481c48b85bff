"""One training sample as the transformer consumes it: latents, text embeds, img_shapes (pure data + a check).

Train and evaluate both build these from the `text` + `vae` tables (`store.join`), so the check that stored
latents agree with the recorded img_shapes lives here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from torch import Tensor

from schemas.errors import UserError


@dataclass
class TrainSample:
    """One joined sample, tensors as stored (bf16, on the CPU, possibly zero-copy views of the shards)."""

    key: str
    target: Tensor  # [C, 1, h, w] normalised latent
    controls: list[Tensor]  # each [C, 1, h_i, w_i]
    prompt_embeds: Tensor  # [L, D] valid tokens only
    empty_embeds: Tensor  # [L0, D] the empty prompt (caption dropout)
    img_shapes: list[tuple[int, int, int]]  # patch units, target first, then each control
    mask_weight: Tensor | None = None  # [N_target] float32 edit mask at the token grid, optional
    nocontrol_embeds: Tensor | None = None  # [L1, D] the instruction without its control images (control dropout)
    slot_mask: Tensor | None = None  # Qwen-Image-2.1: [L] bool, the prompt's image slots (None: an Edit model)
    empty_slot_mask: Tensor | None = None  # Qwen-Image-2.1: [L0] bool, the empty prompt's image slots

    @property
    def target_tokens(self) -> int:
        return prod(self.img_shapes[0])

    @property
    def sequence_tokens(self) -> int:
        """The joint sequence's tokens (target and control image tokens + prompt tokens): the length a token budget
        counts for this sample (`store.join.sequence_lengths_of` reads the same from the manifests)."""
        return sum(prod(s) for s in self.img_shapes) + int(self.prompt_embeds.shape[0])


def from_features(
    key: str, text: dict[str, Tensor], vae: dict[str, Tensor], img_shapes: list, where: str = "the store"
) -> TrainSample:
    """One sample from its stored `text` and `vae` tensors; latent shapes are checked against img_shapes.

    `where` names the vae table version in the error (a contradiction there is store damage)."""
    t, v = text, vae
    shapes = [tuple(int(x) for x in s) for s in img_shapes]
    n_controls = sum(1 for name in v if name.startswith("control_"))
    controls = [v[f"control_{i}"] for i in range(n_controls)]
    latents = [v["target"], *controls]
    per = 1 if "slot_mask" in t else 2  # latent pixels per img_shapes unit: 2.1 has no 2x2 packing
    if len(shapes) != len(latents) or any(
        lat.ndim != 4 or (lat.shape[2] // per, lat.shape[3] // per) != (s[1], s[2]) for lat, s in zip(latents, shapes)
    ):
        raise UserError(
            f"sample {key} in {where}: latent shapes {[tuple(x.shape) for x in latents]} "
            f"do not match img_shapes {shapes}; run `pipeline store verify` on the store"
        )
    mask = v.get("mask_weight")
    return TrainSample(
        key=key,
        target=v["target"],
        controls=controls,
        prompt_embeds=t["prompt_embeds"],
        empty_embeds=t["empty_embeds"],
        img_shapes=shapes,
        mask_weight=mask.float() if mask is not None else None,
        nocontrol_embeds=t.get("nocontrol_embeds"),
        slot_mask=t.get("slot_mask"),
        empty_slot_mask=t.get("empty_slot_mask"),
    )
