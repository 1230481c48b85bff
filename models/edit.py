"""Editing with the stock pipelines' own pieces: one image (or several, for Edit-Plus), an optional LoRA.

`pipeline predict` and evaluate's extra prompts use it.

Each component may sit on its own device (`predict.devices`: a 7B text encoder on one GPU, the transformer on
another, the VAE on the CPU). The stock pipeline's `__call__` runs everything on one "execution device", so this
stage calls the pipeline's own pieces at their seams instead: its image resizing and `encode_prompt` on the text
encoder's device, its `_encode_vae_image` on the VAE's device, then `models.generate` (the same denoising loop
and decode, proven equal to the stock `__call__` in `tests/stages/test_predict.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image

from models.loading import check_device, load_component, model_variant, pipeline_family
from schemas.errors import UserError
from models.generate import Conditioning, generate
from models.lora import attach_lora
from schemas.img_shapes import PIXELS_PER_PATCH

# The stock pipelines' condition sizes (pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE / VAE_IMAGE_SIZE).
VL_AREA_PLUS = 384 * 384
VAE_AREA = 1024 * 1024
COMPONENTS = ("transformer", "text_encoder", "vae")


@dataclass
class PreparedControls:
    vl_images: list[Image.Image]  # what the text encoder sees with the prompt
    vae_pixels: list[torch.Tensor]  # each [1, 3, 1, H, W] in [-1, 1]
    height: int  # default output size: the (last) control's ~1024² size, as the pipelines choose it
    width: int


def load_pipeline(model: str, dtype: torch.dtype, devices: dict[str, str], lora: str | None = None,
                  lora_scale: float = 1.0, transformer=None, vae=None, quantize: str = "none"):
    """The stock Edit / Edit-Plus pipeline assembled from `load_component`, each component loaded straight
    onto its device (never staged whole in host RAM first); the transformer optionally quantised while loading.

    An already loaded transformer / VAE (evaluate's, LoRA attached) is used as is instead of a second copy.
    """
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline

    def dev(name: str):
        return check_device(devices[name], f"predict.devices.{name}") if name in devices else None

    cls = QwenImageEditPlusPipeline if pipeline_family(model_variant(model)) == "edit-plus" else QwenImageEditPipeline
    pipe = cls(
        scheduler=load_component(model, "scheduler"),
        vae=vae if vae is not None else load_component(model, "vae", dtype=dtype, device=dev("vae")),
        text_encoder=load_component(model, "text_encoder", dtype=dtype, device=dev("text_encoder")),
        tokenizer=load_component(model, "tokenizer"),
        processor=load_component(model, "processor"),
        transformer=transformer if transformer is not None else load_component(
            model, "transformer", dtype=dtype, device=dev("transformer"), quantize=quantize),
    )
    if lora is not None:
        attach_lora(pipe.transformer, lora, lora_scale)
    given = {"transformer": transformer, "vae": vae}
    for name in COMPONENTS:  # only what the caller passed in; the rest loaded onto its device above
        if given.get(name) is not None and name in devices:
            getattr(pipe, name).to(check_device(devices[name], f"predict.devices.{name}"))
    return pipe


def prepare_controls(pipe, images: list[Image.Image], plus: bool) -> PreparedControls:
    """Resize the controls exactly as the stock pipeline's `__call__` does (Edit: one ~1024² view for both the
    text encoder and the VAE; Edit-Plus: a ~384² view for the text encoder and a ~1024² view for the VAE each)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions as edit_dims
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions as plus_dims

    proc = pipe.image_processor
    if not plus:
        img = images[0]
        w, h, _ = edit_dims(VAE_AREA, img.size[0] / img.size[1])
        resized = proc.resize(img, h, w)
        return PreparedControls([resized], [proc.preprocess(resized, h, w).unsqueeze(2)], h, w)
    vl, vae = [], []
    for img in images:
        ratio = img.size[0] / img.size[1]
        cw, ch = plus_dims(VL_AREA_PLUS, ratio)
        vw, vh = plus_dims(VAE_AREA, ratio)
        vl.append(proc.resize(img, ch, cw))
        vae.append(proc.preprocess(img, vh, vw).unsqueeze(2))
    w, h = plus_dims(VAE_AREA, images[-1].size[0] / images[-1].size[1])
    return PreparedControls(vl, vae, h, w)


@torch.no_grad()
def prepare(
    pipe,
    images: list[Image.Image],
    prompt: str,
    negative_prompt: str | None,
    true_cfg_scale: float,
    height: int | None = None,
    width: int | None = None,
) -> tuple[Conditioning, int, int]:
    """Text-encode the prompt (and the CFG negative) with the controls and VAE-encode the controls, each on its
    component's device; returns the conditioning on the transformer's device and the output size."""
    from diffusers import QwenImageEditPlusPipeline

    plus = isinstance(pipe, QwenImageEditPlusPipeline)
    if not plus and len(images) != 1:
        raise UserError(f"Qwen-Image-Edit takes exactly one control image, got {len(images)}; use an Edit-Plus model")
    controls = prepare_controls(pipe, images, plus)
    height = (height or controls.height) // PIXELS_PER_PATCH * PIXELS_PER_PATCH
    width = (width or controls.width) // PIXELS_PER_PATCH * PIXELS_PER_PATCH
    if height < PIXELS_PER_PATCH or width < PIXELS_PER_PATCH:
        raise UserError(f"output size {height}x{width} px: height and width must be at least {PIXELS_PER_PATCH} "
                        f"(they are rounded down to multiples of {PIXELS_PER_PATCH})")
    te_device, tr_device = pipe.text_encoder.device, pipe.transformer.device
    vl = controls.vl_images if plus else controls.vl_images[0]

    def encode(text: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        embeds, mask = pipe.encode_prompt(prompt=text, image=vl, device=te_device)
        return embeds.to(tr_device), (mask.to(tr_device) if mask is not None else None)

    embeds, mask = encode(prompt)
    neg_embeds = neg_mask = None
    if true_cfg_scale > 1 and negative_prompt is not None:
        neg_embeds, neg_mask = encode(negative_prompt)
    latents = [
        pipe._encode_vae_image(px.to(pipe.vae.device, pipe.vae.dtype), generator=None).to(tr_device, embeds.dtype)
        for px in controls.vae_pixels
    ]
    return Conditioning(embeds, latents, mask, neg_embeds, neg_mask), height, width


def edit(
    pipe,
    images: list[Image.Image],
    prompt: str,
    negative_prompt: str | None,
    steps: int,
    true_cfg_scale: float,
    seed: int,
    height: int | None = None,
    width: int | None = None,
) -> Image.Image:
    """One edit with the pipeline's components wherever they sit."""
    cond, height, width = prepare(pipe, images, prompt, negative_prompt, true_cfg_scale, height, width)
    return generate(
        pipe.transformer, pipe.vae, dict(pipe.scheduler.config), cond, height, width, steps, true_cfg_scale, seed,
        progress=True,
    )
