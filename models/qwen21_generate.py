"""Qwen-Image-2.1 generation from stored features: the stock `QwenImage21Pipeline.__call__` denoising loop from
its prompt encoding and VAE encoding on (which the store already holds) to the decoded RGBA image.

The stock `__call__` cannot start from precomputed embeddings when there are references (it has no argument
for their image-slot mask), so the loop is written here to match it step for step: the same start noise
(`randn_tensor` on (1, 1, C, h, w), flattened), the same sigmas (the model's `sample_sigmas`, model_index.json,
which the stock call prefers to `num_inference_steps`; else linspace(1, 1/steps)), the same `calculate_shift` mu from the scheduler config, the stock transformer at batch
1 with the sample's own layout (no KV cache: the cache changes rounding, see the pipeline's `use_kv_cache`),
true CFG as the pipeline computes it, the same de-normalisation and VAE decode. Tested against the unmodified
pipeline (`use_kv_cache=False`).
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift, retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from models.qwen21_multires import TOKENS_PER_SLOT, latent_tokens

# The key under which the model's sampling sigmas travel with the scheduler config (evaluate passes one dict).
SAMPLE_SIGMAS = "sample_sigmas"


def pipeline_sample_sigmas(model: str) -> list[float] | None:
    """The sampling sigmas the model's author fixed (`QwenImage21Pipeline(sample_sigmas=...)`, saved in its
    model_index.json), which `from_pretrained` hands the stock pipeline; None when unset."""
    import json

    from models.loading import resolve_model

    sigmas = json.loads((resolve_model(model) / "model_index.json").read_text()).get(SAMPLE_SIGMAS)
    return [float(x) for x in sigmas] if sigmas else None


def scheduler_config_21(model: str) -> dict:
    """The model's scheduler config, with its `sample_sigmas` (when set) under SAMPLE_SIGMAS."""
    from models.loading import load_component

    config = dict(load_component(model, "scheduler").config)
    if (sigmas := pipeline_sample_sigmas(model)) is not None:
        config[SAMPLE_SIGMAS] = sigmas
    return config


def scheduler_and_sigmas(config: dict):
    """(a fresh scheduler, the sample sigmas or None) from `scheduler_config_21`'s dict."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = dict(config)
    sigmas = config.pop(SAMPLE_SIGMAS, None)
    return FlowMatchEulerDiscreteScheduler.from_config(config), sigmas


@torch.no_grad()
def generate_21(transformer, vae, scheduler, prompt_embeds: torch.Tensor, slot_mask: torch.Tensor,
                references: list[torch.Tensor], height: int, width: int, steps: int, seed: int,
                true_cfg_scale: float = 1.0, negative: tuple[torch.Tensor, torch.Tensor] | None = None,
                sample_sigmas: list[float] | None = None, output_type: str = "pil"):
    """One image. prompt_embeds [L, D] and slot_mask [L] as stored; references: normalised latents [C, 1, h, w]
    (the vae table's control_i); negative: (embeds, slot mask) of the negative prompt for true CFG."""
    device, dtype = transformer.device, transformer.dtype
    channels = transformer.config.in_channels
    h, w = 2 * (height // 32), 2 * (width // 32)
    generator = torch.Generator("cpu").manual_seed(seed)
    latents = randn_tensor((1, 1, channels, h, w), generator=generator, device=device, dtype=dtype)
    latents = latents.view(1, channels, h * w).transpose(1, 2)
    refs = [latent_tokens(r).to(device, dtype) for r in references]
    shapes = [[(1, r.shape[-2], r.shape[-1]) for r in references] + [(1, h, w)]]

    def img_mask(slots: torch.Tensor) -> torch.Tensor:
        return torch.cat([slots.bool(), slots.new_ones(h * w // TOKENS_PER_SLOT, dtype=torch.bool)])[None].to(device)

    sigmas = sample_sigmas if sample_sigmas is not None else np.linspace(1.0, 1 / steps, steps)
    cfg = scheduler.config
    mu = calculate_shift(latents.shape[1], cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                         cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    cond = (prompt_embeds[None].to(device, dtype), img_mask(slot_mask))
    uncond = None if negative is None or true_cfg_scale <= 1 else (negative[0][None].to(device, dtype), img_mask(negative[1]))
    for t in timesteps:
        model_input = torch.cat([*refs, latents[0]])[None] if refs else latents
        timestep = t.expand(1).to(dtype) / 1000

        def predict(embeds, mask):
            out = transformer(hidden_states=model_input, timestep=timestep, encoder_hidden_states=embeds,
                              img_shapes=shapes, img_mask=mask, return_dict=False)[0]
            return out[:, -latents.shape[1]:]

        noise_pred = predict(*cond)
        if uncond is not None:
            neg = predict(*uncond)
            noise_pred = neg + true_cfg_scale * (noise_pred - neg)
        latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
    latents = latents.transpose(1, 2).reshape(1, channels, 1, h, w).to(vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    std = torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    image = vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
    return VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=vae.config.z_dim).postprocess(
        image, output_type=output_type)[0]
