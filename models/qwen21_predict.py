"""`pipeline predict` on a Qwen-Image-2.1 model: the stock `QwenImage21Pipeline`, components from `load_component`
on their devices, the LoRA attached as for the other variants (`models.lora.attach_lora`), references as given
(RGBA kept: the pipeline composites over white for the VLM and gives the VAE all four channels); RGBA out."""

from __future__ import annotations

import torch

from models.control_shapes import MAX_VL_ASPECT
from models.loading import check_device, load_component
from models.lora import attach_lora
from models.qwen21_generate import pipeline_sample_sigmas

COMPONENTS = ("transformer", "text_encoder", "vae")
# QwenImage21Pipeline's default true_cfg_scale: 2.1 "is meant to be sampled without guidance"
TRUE_CFG_21 = 1.0


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


def check_reference_count(n: int, model: str, what: str, advice: str) -> None:
    """More than the model's 10 references refused in one line before anything is loaded: the stock pipeline
    takes any number and gives the transformer a layout it was never trained on (encode quarantines such samples,
    `control-count`)."""
    from models.qwen21_multires import MAX_REFERENCES
    from schemas.errors import UserError

    if n > MAX_REFERENCES:
        raise UserError(f"{what}: {n} reference images, but Qwen-Image-2.1 ({model}) takes at most {MAX_REFERENCES}; "
                        f"{advice}")


def check_prompt_before_loading(model: str, images: list, prompt: str, negative_prompt: str | None,
                                height: int | None, width: int | None) -> None:
    """`check_prompt_fits` with the processor alone (the tokenizer it needs), before the transformer, text
    encoder and VAE load: a prompt past the RoPE table was refused only after minutes of loading them."""
    check_prompt_fits(tokenizer_only(model), images, prompt, negative_prompt, height, width)


def tokenizer_only(model: str):
    """The stock pipeline holding the processor alone: what `check_prompt_fits` reads (its templates, tokenizer)."""
    from diffusers import QwenImage21Pipeline

    from models.loading import load_component

    return QwenImage21Pipeline(scheduler=None, vae=None, text_encoder=None, transformer=None,
                               processor=load_component(model, "processor"))


def _text_tokens(pipe, prompt: str, n_images: int) -> int:
    """Text tokens of the prompt's embeddings as `_get_qwen_prompt_embeds` builds them (its template, its image
    slots, its system-token drop), counted with the tokenizer alone: each image is one `<|image_pad|>` here (the
    processor repeats it, and slots take no text position)."""
    template = pipe.prompt_template_t2i if n_images == 0 else pipe.prompt_template_ti2i.replace(
        "<image1><|vision_start|><|image_pad|><|vision_end|>",
        " ".join(f"<image{i}><|vision_start|><|image_pad|><|vision_end|>" for i in range(1, n_images + 1)))
    ids = pipe.processor.tokenizer(template.format(prompt or " "))["input_ids"]
    return len(ids) - ids.count(pipe._img_token_id) - pipe._drop_idx


def media_placeholders(text: str, processor) -> list[str]:
    """The processor's media placeholder tokens (`<|image_pad|>`, `<|video_pad|>`) that `text` holds: the stock
    pipelines' processor counts them against the pictures / videos passed and refuses such a prompt (encode-text
    quarantines such a caption, `stages.encode.intake.placeholder_rejection`)."""
    return [t for t in (getattr(processor, f"{m}_token", None) for m in ("image", "video", "audio"))
            if isinstance(t, str) and t and t in text]


def refuse_placeholders(processor, what: str, text: str) -> None:
    """One line where `text` (the prompt or negative prompt) holds a `media_placeholders` token: the stock
    pipelines (2.1 and the Edit models alike) fail on it with the processor's ValueError, after every component
    has loaded."""
    from schemas.errors import UserError

    if held := media_placeholders(text, processor):
        raise UserError(f"the {what} holds {', '.join(held)}, a placeholder the model's processor reserves for a "
                        f"picture or video (the stock pipeline refuses such a prompt); remove it from the {what}")


def check_placeholders_before_loading(model: str, prompts: list[tuple[str, str | None]],
                                      negative_prompt: str | None) -> None:
    """`refuse_placeholders` for an Edit / Edit-Plus model with its processor alone, before the transformer, text
    encoder and VAE load (a 2.1 model's prompts meet it in `check_prompt_fits`). `prompts`: (where it is set, the
    prompt); `negative_prompt`: None where it is not encoded (no true CFG)."""
    from models.loading import load_component
    from schemas.errors import UserError

    processor = load_component(model, "processor")
    for where, prompt in prompts:
        try:
            for what, text in (("prompt", prompt), ("negative prompt", negative_prompt)):
                if text is not None:
                    refuse_placeholders(processor, what, text)
        except UserError as e:
            raise UserError(f"{where}{e}") from None


def check_prompt_fits(pipe, images: list, prompt: str, negative_prompt: str | None, height: int | None,
                      width: int | None) -> int:
    """Positions left after the target's (>= 0), or a UserError when the target would sit past the transformer's
    frame positions (as encode-text quarantines such a caption): the stock RoPE would read its negative rows for
    the overflow (a silently wrong image) and fail past them. References at the size the pipeline gives them."""
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

    from models.qwen21_text import frame_positions, target_frame_position
    from schemas.errors import UserError

    area = round((height * width) ** 0.5) ** 2 if height and width else 1024 * 1024  # edit_21's output_resolution
    refs = []
    for im in images:
        w, h, _ = calculate_dimensions(area, im.size[0] / im.size[1])
        check_reference_grid(pipe.processor.image_processor, h, w, area)
        refs.append((h // 16, w // 16))
    left = frame_positions()
    for what, text in (("prompt", prompt), ("negative prompt", negative_prompt)):
        if text is None:
            continue
        refuse_placeholders(pipe.processor, what, text)  # the processor's ValueError, after loading the model
        tokens = _text_tokens(pipe, text, len(images))
        at = target_frame_position(tokens, refs)
        if at >= frame_positions():
            raise UserError(f"the {what} is {tokens} text tokens; with {len(images)} reference(s) the target sits at "
                            f"frame position {at}, past the transformer's {frame_positions()} frame positions (its "
                            f"RoPE table); shorten the {what}")
        left = min(left, frame_positions() - 1 - at)
    return left


def processor_pixel_bounds(image_processor) -> tuple[int, int]:
    """(min, max) pixels of an image the VLM image processor keeps as it is (its `size`, which `smart_resize`
    bounds it by): the one reader of them (predict's checks, encode-text's quarantine, run all's area check)."""
    return image_processor.size["shortest_edge"], image_processor.size["longest_edge"]


def processor_keeps(image_processor, height: int, width: int) -> bool:
    """Whether the VLM image processor reads a height x width image as it is (transformers' `smart_resize`, which
    Qwen3-VL's processor calls, returns its size): False where it would resize it (outside its min / max pixels)
    or cannot read it (a longer side over 200x the shorter, a 0 px side)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    factor = image_processor.patch_size * image_processor.merge_size
    try:
        return smart_resize(height, width, factor, *processor_pixel_bounds(image_processor)) == (height, width)
    except (ValueError, ZeroDivisionError):
        return False


def check_reference_grid(image_processor, height: int, width: int, area: int) -> None:
    """A UserError when the processor would resize a reference of height x width (the pipeline's size for it at
    the reference area `area`) for the VLM: its slots would then not be the VAE's 2x2-latent grid, and the
    transformer fails with a shape mismatch (encode-text quarantines such a sample: `grid_mismatch`)."""
    from schemas.errors import UserError

    min_pixels, max_pixels = processor_pixel_bounds(image_processor)

    def kept(h: int, w: int) -> bool:
        return processor_keeps(image_processor, h, w)

    if min(height, width) < 1 or max(height, width) / min(height, width) > MAX_VL_ASPECT:  # smart_resize's limit / 0
        raise UserError(f"a reference sized {width}x{height} px (output area {area} px) is too elongated for the "
                        f"model's VLM processor (at most {MAX_VL_ASPECT}:1, no side 0 px): crop it, or pass a larger "
                        "--height / --width (predict) or height / width (evaluate.extra_prompts)")
    if not kept(height, width):
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

        def fits(side: int) -> bool:
            return kept(*calculate_dimensions(side * side, width / height)[1::-1])

        side = int(max_pixels ** 0.5) // 32 * 32  # the largest square output whose reference the processor keeps
        while side > 32 and not fits(side):
            side -= 32
        todo = (f"pass --height / --width (predict) or height / width (evaluate.extra_prompts) with height x width "
                f"within them, e.g. {side} x {side}" if fits(side) else
                "no output size keeps a reference this elongated: crop it to a less extreme aspect ratio")
        raise UserError(f"a reference sized {width}x{height} px (output area {area} px) is outside the model's VLM "
                        f"processor limits ({min_pixels}..{max_pixels} px in its processor/ folder): it "
                        f"would resize it and its grid would no longer match the VAE's; {todo}")


@torch.no_grad()
def edit_21(pipe, images: list, prompt: str, negative_prompt: str | None, steps: int, true_cfg_scale: float,
            seed: int, height: int | None, width: int | None):
    """One image (PIL, RGBA) from 0..10 references and the instruction, by the stock pipeline call."""
    check_prompt_fits(pipe, images, prompt, negative_prompt if true_cfg_scale > 1 else None, height, width)
    generator = torch.Generator("cpu").manual_seed(seed)
    # The pipeline resizes each reference to output_resolution² (default 1024²): with an output size given,
    # the references get that area, as resize-bucket sizes them with equal target and reference areas.
    extra = {"output_resolution": round((height * width) ** 0.5)} if height and width else {}
    out = pipe(image=images or None, prompt=prompt, negative_prompt=negative_prompt if true_cfg_scale > 1 else None,
               true_cfg_scale=true_cfg_scale, num_inference_steps=steps, height=height, width=width,
               generator=generator, output_type="pil", **extra)
    return out.images[0]


def vlm_pixel_limits(model: str) -> tuple[int, int]:
    """(min, max) pixels of an image the model's VLM processor keeps as it is (`smart_resize`'s bounds; outside
    them it resizes the image and its grid no longer matches the VAE's). The image processor alone is read."""
    from transformers import AutoImageProcessor

    from models.loading import resolve_model

    return processor_pixel_bounds(AutoImageProcessor.from_pretrained(resolve_model(model) / "processor"))


def reference_area_refusal(area: int, model: str) -> str | None:
    """The line refusing a `resize.control_vae_area` (each reference's area, which the VLM reads as it is) outside
    the model's VLM processor limits, None within them: said by `pipeline run all` for a run with references
    (`pipeline.reference_area`: before resize-bucket, or right after it where only the source's samples tell). The
    processor would resize every reference, and encode-text ran the VLM on each sample and then quarantined it ("VLM
    grid differs from the VAE grid"). References near a limit may still round past it at some aspects: encode-text
    quarantines those."""
    low, high = vlm_pixel_limits(model)
    if not low <= area <= high:
        return (f"resize.control_vae_area = {area}: {model} (Qwen-Image-2.1)'s VLM processor keeps images of "
                f"{low}..{high} px (its processor/ folder) and reads each reference at that area, so it would "
                "resize every one and encode-text would quarantine them all (VLM grid differs from the VAE "
                f"grid); set resize.control_vae_area within {low}..{high} (the pipeline's output_resolution², "
                "1048576 for the released model)")
    return None
