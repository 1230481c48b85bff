"""The flow-matching batch of Qwen-Image-2.1 samples (`models/flow.py` branches here for 2.1 samples).

Same flow arithmetic as the Edit path (x_t = (1-σ)·x0 + σ·ε, target ε - x0, loss on each sample's own target
tokens, normalised per sample, optional edit-mask token weights), on 2.1's unpacked latent tokens (one token
per latent pixel of the 16x VAE) and through `models.qwen21_multires` (mixed layouts in one padded batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from models.qwen21_multires import Qwen21Batch, Qwen21Sample, build_batch, latent_tokens, qwen21_forward, target_outputs

if TYPE_CHECKING:
    from models.flow import FlowBatch
    from models.sample import TrainSample


def is_qwen21(transformer) -> bool:
    from models.qwen21_multires import _unwrap

    return type(_unwrap(transformer)).__name__ == "QwenImage21Transformer2DModel"


def prepare_flow_batch_21(samples: list[TrainSample], sigmas: Tensor, noises: list[Tensor],
                          use_empty: list[bool] | None, mask_weight: tuple[float, float],
                          device: torch.device, dtype: torch.dtype) -> FlowBatch:
    from models.flow import FlowBatch, add_noise, flow_target, mask_token_weights

    sigmas = sigmas.to(device=device, dtype=torch.float32)
    x0 = [latent_tokens(s.target).to(device=device, dtype=torch.float32) for s in samples]
    eps = [latent_tokens(n).to(device=device, dtype=torch.float32) for n in noises]
    rows = []
    for i, (s, x, e) in enumerate(zip(samples, x0, eps)):
        empty = use_empty is not None and use_empty[i]
        rows.append(Qwen21Sample(
            prompt_embeds=(s.empty_embeds if empty else s.prompt_embeds).to(device=device, dtype=dtype),
            slot_mask=(s.empty_slot_mask if empty else s.slot_mask).to(device),
            references=[c.to(device=device, dtype=dtype) for c in s.controls],
            target=add_noise(x, e, sigmas[i]).to(dtype),
            target_hw=(int(s.img_shapes[0][1]), int(s.img_shapes[0][2])),
        ))
    weights = None
    if tuple(mask_weight) != (1.0, 1.0):
        weights = [mask_token_weights(s.mask_weight, *mask_weight) if s.mask_weight is not None else None
                   for s in samples]
    return FlowBatch(build_batch(rows), sigmas, [flow_target(x, e) for x, e in zip(x0, eps)], weights)


def predictions_21(transformer, batch: Qwen21Batch, sigmas: Tensor) -> list[Tensor]:
    """Each sample's predicted velocity on its target tokens; the 2.1 pipeline passes σ as the timestep (t/1000).
    `transformer` may be the training wrapper (DDP over `Qwen21Batched`): the call goes through it."""
    from models.qwen21_multires import _unwrap

    return target_outputs(qwen21_forward(transformer, batch, sigmas.to(_unwrap(transformer).dtype)), batch)


def check_shapes_21(sample: TrainSample, transformer, where: str) -> str | None:
    cfg = transformer.config
    c, d = sample.target.shape[0], sample.prompt_embeds.shape[1]
    if c != cfg.in_channels or d != cfg.context_in_dim:
        return (f"store {where} holds latents with {c} channels and text embeds of width {d}, but the Qwen-Image-2.1 "
                f"transformer expects {cfg.in_channels} and {cfg.context_in_dim}: wrong --model?")
    return None
