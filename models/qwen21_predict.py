"""`pipeline predict` on a Qwen-Image-2.1 model: the stock `QwenImage21Pipeline`, components from `load_component`
on their devices, the LoRA attached as for the other variants (`models.lora.attach_lora`), references as given
(RGBA kept: the pipeline composites over white for the VLM and gives the VAE all four channels); RGBA out."""

from __future__ import annotations

import torch

from models.loading import check_device, load_component
from models.lora import attach_lora
from models.qwen21_generate import pipeline_sample_sigmas

COMPONENTS = ("transformer", "text_encoder", "vae")


def load_pipeline_21(model: str, dtype: torch.dtype, devices: dict[str, str], lora: str | None = None,
                     lora_scale: float = 1.0, quantize: str = "none"):
    from diffusers import QwenImage21Pipeline

    from schemas.errors import UserError

    def dev(name: str):
        return check_device(devices[name], f"predict.devices.{name}") if name in devices else None

    if len({str(dev(n)) for n in COMPONENTS}) > 1:  # the stock pipeline runs every component on one device
        raise UserError(f"predict.devices: a Qwen-Image-2.1 model runs with every component on one device "
                        f"(got {dict(devices)}); set transformer, text_encoder and vae to the same device")

    pipe = QwenImage21Pipeline(
        scheduler=load_component(model, "scheduler"),
        vae=load_component(model, "vae", dtype=dtype, device=dev("vae")),
        text_encoder=load_component(model, "text_encoder", dtype=dtype, device=dev("text_encoder")),
        processor=load_component(model, "processor"),
        transformer=load_component(model, "transformer", dtype=dtype, device=dev("transformer"), quantize=quantize),
        sample_sigmas=pipeline_sample_sigmas(model),  # as from_pretrained reads them from model_index.json
    )
    if lora is not None:
        attach_lora(pipe.transformer, lora, lora_scale)
    return pipe


@torch.no_grad()
def edit_21(pipe, images: list, prompt: str, negative_prompt: str | None, steps: int, true_cfg_scale: float,
            seed: int, height: int | None, width: int | None):
    """One image (PIL, RGBA) from 0..10 references and the instruction, by the stock pipeline call."""
    generator = torch.Generator("cpu").manual_seed(seed)
    # The pipeline resizes each reference to output_resolution² (default 1024²): with an output size given,
    # the references get that area, as resize-bucket sizes them with equal target and reference areas.
    extra = {"output_resolution": round((height * width) ** 0.5)} if height and width else {}
    out = pipe(image=images or None, prompt=prompt, negative_prompt=negative_prompt if true_cfg_scale > 1 else None,
               true_cfg_scale=true_cfg_scale, num_inference_steps=steps, height=height, width=width,
               generator=generator, output_type="pil", **extra)
    return out.images[0]
