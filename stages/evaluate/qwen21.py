"""evaluate's val-sample images for a Qwen-Image-2.1 model: base and LoRA images of each picked val sample,
generated from its stored features (`models.qwen21_generate`, the stock pipeline's loop), with the stored empty
prompt (same references) as the true-CFG negative when `evaluate.true_cfg_scale` > 1."""

from __future__ import annotations

from diffusers import QwenImage21Pipeline
from tqdm.auto import tqdm


def image_21(transformer, vae, scheduler_config: dict, s, cfg):
    """One val sample's image from its stored features, by the transformer as it is now (LoRA on or off), RGB
    over white (the report and its scores are RGB; 2.1 decodes RGBA, and its targets are composited over white)."""
    from features.pictures import rgb_over_white
    from models.qwen21_generate import generate_21, scheduler_and_sigmas

    _, h, w = s.img_shapes[0]  # latent tokens of 16 px
    scheduler, sigmas = scheduler_and_sigmas(scheduler_config)  # `scheduler_config_21`: the model's sigmas too
    image = generate_21(transformer, vae, scheduler, s.prompt_embeds, s.slot_mask, list(s.controls), h * 16, w * 16,
                        cfg.num_inference_steps, cfg.seed, cfg.true_cfg_scale, (s.empty_embeds, s.empty_slot_mask),
                        sample_sigmas=sigmas)
    return rgb_over_white(image)  # convert("RGB") drops the alpha: a perfect output scored ~1 dB PSNR



def check_extra_prompts_21(cfg, model: str) -> None:
    """Each extra prompt against the transformer's RoPE table (`check_prompt_fits`, as `extra_inputs_21` checks it)
    with the processor alone, before anything loads: it was met only when the images were made, after the
    held-out loss passes (hours on a large val set)."""
    from features.decode import read_image_file
    from models.control_shapes import check_control_shapes
    from models.qwen21_predict import check_prompt_fits, tokenizer_only
    from schemas.errors import UserError

    pipe = tokenizer_only(model)
    negative = cfg.negative_prompt if cfg.true_cfg_scale > 1 else None
    for i, extra in enumerate(cfg.extra_prompts):
        what = f"evaluate.extra_prompts[{i}] image"
        refs = [read_image_file(p, keep_alpha=True, what=what) for p in extra.images]
        check_control_shapes(extra.images, refs, "qwen-image-2.1", extra.height, extra.width, what)  # names the file
        try:
            check_prompt_fits(pipe, refs, extra.prompt, negative, extra.height, extra.width)
        except UserError as e:
            raise UserError(f"evaluate.extra_prompts[{i}]: {e}") from None


def extra_inputs_21(model: str, transformer, vae, cfg):
    """`evaluate.extra_prompts` on a 2.1 model, as `sample_images.extra_prompt_inputs` yields them for the others, with
    `cond` a function giving the image of the transformer as it is when called (LoRA on, off, or another
    checkpoint): the stock `QwenImage21Pipeline` call predict makes (`models.qwen21_predict.edit_21`) over this
    transformer and VAE. Every prompt (and the negative under true CFG) is encoded once, by the stock
    `encode_prompt`, before the first image; the text encoder is then dropped (as the Edit path drops its
    pipeline), so it does not sit on the device through the base / LoRA / best / last generations, and no column
    encodes a prompt again. References keep their alpha (the pipeline composites them over white for the VLM);
    the report's images and scores are RGB."""
    from features.decode import read_image_file
    from features.pictures import rgb_over_white
    from models.loading import load_component, parse_dtype
    from models.qwen21_generate import pipeline_sample_sigmas
    from models.qwen21_predict import check_prompt_fits, edit_21

    parts = dict(scheduler=load_component(model, "scheduler"), vae=vae, processor=load_component(model, "processor"),
                 transformer=transformer, sample_sigmas=pipeline_sample_sigmas(model))
    negative = cfg.negative_prompt if cfg.true_cfg_scale > 1 else None  # edit_21 passes it only then
    encoder = QwenImage21Pipeline(
        text_encoder=load_component(model, "text_encoder", dtype=parse_dtype(cfg.dtype), device=cfg.device), **parts)
    inputs = []
    for i, extra in enumerate(tqdm(cfg.extra_prompts, desc="encode extra prompts")):
        # decoded as predict decodes them (features.decode: EXIF, CMYK, 16-bit; alpha kept for the 2.1 VAE)
        refs = [read_image_file(p, keep_alpha=True, what=f"evaluate.extra_prompts[{i}] image")
                for p in extra.images]
        target = (read_image_file(extra.target, what=f"evaluate.extra_prompts[{i}] target")
                  if extra.target else None)
        check_prompt_fits(encoder, refs, extra.prompt, negative, extra.height, extra.width)  # before encoding it
        inputs.append((i, extra, refs, target, prompt_encodings(encoder, refs, [extra.prompt, negative],
                                                                extra.height, extra.width)))
    del encoder  # the text encoder with it: nothing below holds it
    pipe = _PreEncoded(text_encoder=None, **parts)
    for i, extra, refs, target, encodings in inputs:
        def cond(refs=refs, extra=extra, encodings=encodings):
            pipe.encodings = encodings
            return rgb_over_white(edit_21(pipe, refs, extra.prompt, cfg.negative_prompt, cfg.num_inference_steps,
                                          cfg.true_cfg_scale, cfg.seed, extra.height, extra.width))

        yield (f"extra {i + 1}", extra.prompt, [rgb_over_white(r) for r in refs], target, cond, extra.height,
               extra.width, dict(pipe.scheduler.config))


def prompt_encodings(pipe, refs: list, prompts: list, height: int | None, width: int | None) -> dict:
    """prompt -> the stock `encode_prompt`'s (embeds, mask, image-pad mask) with the references as the stock
    `__call__` hands them to it under `edit_21` (RGBA, each resized to output_resolution² at its own aspect
    ratio, output_resolution being edit_21's); None prompts are skipped."""
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

    side = round((height * width) ** 0.5) if height and width else 1024  # edit_21's output_resolution
    images = None
    if refs:
        images = []
        for img in refs:
            img = img if img.mode == "RGBA" else img.convert("RGBA")
            w, h, _ = calculate_dimensions(side * side, img.size[0] / img.size[1])
            images.append(pipe.image_processor.resize(img, width=w, height=h))
    return {p: pipe.encode_prompt(p, image=images, device=pipe._execution_device) for p in prompts if p is not None}


class _PreEncoded(QwenImage21Pipeline):
    """The stock pipeline without a text encoder, answering `encode_prompt` from `encodings` (`prompt_encodings`,
    set before each call). Why not pass `prompt_embeds`: the stock `__call__` has no argument for their image-pad
    mask, and refuses precomputed embeddings when there are references. Everything else is the stock call."""

    encodings: dict = {}

    def encode_prompt(self, prompt, image=None, device=None, num_images_per_prompt: int = 1, prompt_embeds=None,
                      prompt_embeds_mask=None, image_pad_mask=None):
        assert num_images_per_prompt == 1 and prompt_embeds is None, "edit_21 makes one image from a prompt"
        return self.encodings[prompt]
