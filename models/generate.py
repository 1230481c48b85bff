"""Edit generation from prepared inputs: the stock Qwen-Image-Edit(-Plus) denoising loop, cut at its seams.

The diffusers pipelines do four things in one `__call__`: encode the prompt (text encoder), encode the control
images (VAE), denoise (transformer + scheduler), decode (VAE). Evaluate already holds the first two in the store
and predict wants each component on its own device, so this module holds only the last two, written to match
`QwenImageEditPipeline.__call__` / `QwenImageEditPlusPipeline.__call__` step for step: the same noise
(`randn_tensor` on the unpacked latent shape, then packed), the same dynamic-shift `mu`, the same scheduler
sigmas, the same true-CFG formula including its norm rescale, the same latent de-normalisation before the VAE
decode. `tests/stages/test_predict.py` checks the result equals the unmodified pipeline's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_shift  # the pipelines' own mu
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from models.multires import pack_latents as pack_one, unpack_latents as unpack_one
from schemas.img_shapes import PIXELS_PER_PATCH
from tqdm.auto import tqdm



@dataclass
class Conditioning:
    """Everything the denoiser needs besides noise: text embeds and normalised control latents."""

    prompt_embeds: torch.Tensor  # [1, L, D]
    control_latents: list[torch.Tensor]  # each [1, C, 1, h, w], normalised with the VAE's latents_mean/std
    prompt_mask: torch.Tensor | None = None  # [1, L]; None = all tokens valid (the pipelines drop an all-ones mask)
    negative_embeds: torch.Tensor | None = None  # [1, L0, D]; None = no true CFG
    negative_mask: torch.Tensor | None = None


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, 1, h, w] -> [B, h/2 * w/2, C*4] (2x2 patches), as the pipelines' `_pack_latents`."""
    return torch.stack([pack_one(x) for x in latents])


def unpack_latents(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Packed [B, N, C*4] -> [B, C, 1, h, w] for an image of height x width pixels (`_unpack_latents`)."""
    h, w = 2 * (height // PIXELS_PER_PATCH), 2 * (width // PIXELS_PER_PATCH)
    return torch.stack([unpack_one(x, h, w) for x in latents])


def initial_noise(
    generator: torch.Generator | None, channels: int, height: int, width: int, device, dtype: torch.dtype
) -> torch.Tensor:
    """Packed start noise, drawn exactly as the pipelines' `prepare_latents` draws it (same seed, same noise)."""
    shape = (1, 1, channels, 2 * (height // PIXELS_PER_PATCH), 2 * (width // PIXELS_PER_PATCH))
    noise = randn_tensor(shape, generator=generator, device=torch.device(device), dtype=dtype)
    return pack_latents(noise.permute(0, 2, 1, 3, 4))  # (B,1,C,h,w) viewed as the pipelines do


def img_shapes_for(height: int, width: int, control_latents: list[torch.Tensor]) -> list[list[tuple[int, int, int]]]:
    """RoPE shapes in patch units: the target first, then each control (what the transformer needs)."""
    shapes = [(1, height // PIXELS_PER_PATCH, width // PIXELS_PER_PATCH)]
    shapes += [(1, c.shape[-2] // 2, c.shape[-1] // 2) for c in control_latents]
    return [shapes]


def _predict(transformer, x, t, embeds, mask, img_shapes, n_target: int, name: str) -> torch.Tensor:
    with transformer.cache_context(name):
        out = transformer(
            hidden_states=x,
            timestep=t / 1000,
            guidance=None,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds,
            img_shapes=img_shapes,
            attention_kwargs={},
            return_dict=False,
        )[0]
    return out[:, :n_target]


@torch.no_grad()
def denoise(
    transformer,
    scheduler_config: dict,
    cond: Conditioning,
    height: int,
    width: int,
    num_inference_steps: int,
    true_cfg_scale: float,
    generator: torch.Generator | None = None,
    latents: torch.Tensor | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Run the Euler flow-matching loop; returns the packed target latents [1, N, C*4]."""
    device = cond.prompt_embeds.device
    dtype = cond.prompt_embeds.dtype
    channels = transformer.config.in_channels // 4
    if latents is None:
        latents = initial_noise(generator, channels, height, width, device, dtype)
    latents = latents.to(device=device, dtype=dtype)
    controls = None  # packed control tokens, appended after the target tokens at every step
    if cond.control_latents:
        controls = torch.cat([pack_latents(c.to(device=device, dtype=dtype)) for c in cond.control_latents], dim=1)
    img_shapes = img_shapes_for(height, width, cond.control_latents)

    # A fresh scheduler per call: FlowMatchEulerDiscreteScheduler keeps a step index between calls.
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
    mu = calculate_shift(
        latents.shape[1],
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", 1.15),
    )
    scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)
    scheduler.set_begin_index(0)
    do_true_cfg = true_cfg_scale > 1 and cond.negative_embeds is not None

    for t in tqdm(scheduler.timesteps, desc="denoise", unit="step", leave=False, disable=not progress):
        x = latents if controls is None else torch.cat([latents, controls], dim=1)
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        n = latents.size(1)
        noise_pred = _predict(transformer, x, timestep, cond.prompt_embeds, cond.prompt_mask, img_shapes, n, "cond")
        if do_true_cfg:
            neg = _predict(transformer, x, timestep, cond.negative_embeds, cond.negative_mask, img_shapes, n, "uncond")
            comb = neg + true_cfg_scale * (noise_pred - neg)
            # The pipelines rescale the guided prediction back to the conditional prediction's norm per token.
            noise_pred = comb * (torch.norm(noise_pred, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
        latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
    return latents


@torch.no_grad()
def decode(vae, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Packed normalised latents -> image tensor [1, 3, H, W] in [-1, 1] (the pipelines' decode step)."""
    x = unpack_latents(latents, height, width).to(device=vae.device, dtype=vae.dtype)
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x.device, x.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(x.device, x.dtype)
    x = x / inv_std + mean
    return vae.decode(x, return_dict=False)[0][:, :, 0]


def to_pil(image: torch.Tensor) -> Image.Image:
    """[1, 3, H, W] in [-1, 1] -> PIL, with the pipelines' own post-processing (rounding included)."""
    # In the decoded dtype, as the stock call hands it over: postprocess maps to [0, 1] before it casts to float,
    # and a bf16 VAE's x / 2 + 0.5 rounds in bf16 there (cast first, pixels came out one level off).
    return VaeImageProcessor(vae_scale_factor=PIXELS_PER_PATCH).postprocess(image, output_type="pil")[0]


def generate(
    transformer,
    vae,
    scheduler_config: dict,
    cond: Conditioning,
    height: int,
    width: int,
    num_inference_steps: int,
    true_cfg_scale: float,
    seed: int,
    progress: bool = False,
) -> Image.Image:
    """Seeded edit from prepared conditioning: denoise on the transformer's device, decode on the VAE's."""
    generator = torch.Generator("cpu").manual_seed(seed)
    latents = denoise(
        transformer, scheduler_config, cond, height, width, num_inference_steps, true_cfg_scale, generator,
        progress=progress,
    )
    return to_pil(decode(vae, latents, height, width))
