"""evaluate's val-sample images for a Qwen-Image-2.1 model: base and LoRA images of each picked val sample,
generated from its stored features (`models.qwen21_generate`, the stock pipeline's loop), with the stored empty
prompt (same references) as the true-CFG negative when `evaluate.true_cfg_scale` > 1."""

from __future__ import annotations

from tqdm.auto import tqdm


def val_rows_21(transformer, vae, scheduler_config: dict, samples, images, cfg, damaged=None) -> list:
    from stages.evaluate.report import SampleRow
    from stages.evaluate.stage import _scores, lora_enabled, stored_pictures

    rows = []
    for s in tqdm(samples, desc="generate val samples"):
        pair = []
        for on in (False, True):
            with lora_enabled(transformer, on):
                pair.append(image_21(transformer, vae, scheduler_config, s, cfg))
        caption, controls, target = stored_pictures(images, s, cfg.on_damaged, damaged)
        rows.append(SampleRow(s.key[:12], caption, controls, target, pair[0], pair[1],
                              _scores(target, pair[0], pair[1])))
    return rows


def image_21(transformer, vae, scheduler_config: dict, s, cfg):
    """One val sample's image from its stored features, by the transformer as it is now (LoRA on or off), RGB
    (the report and its scores are RGB)."""
    from models.qwen21_generate import generate_21, scheduler_and_sigmas

    _, h, w = s.img_shapes[0]  # latent tokens of 16 px
    scheduler, sigmas = scheduler_and_sigmas(scheduler_config)  # `scheduler_config_21`: the model's sigmas too
    image = generate_21(transformer, vae, scheduler, s.prompt_embeds, s.slot_mask, list(s.controls), h * 16, w * 16,
                        cfg.num_inference_steps, cfg.seed, cfg.true_cfg_scale, (s.empty_embeds, s.empty_slot_mask),
                        sample_sigmas=sigmas)
    return image.convert("RGB")



def extra_inputs_21(model: str, transformer, vae, cfg):
    """`evaluate.extra_prompts` on a 2.1 model, as `stage.extra_prompt_inputs` yields them for the others, with
    `cond` a function giving the image of the transformer as it is when called (LoRA on, off, or another
    checkpoint): the stock `QwenImage21Pipeline` call predict makes (`models.qwen21_predict.edit_21`) over this
    transformer and VAE, the text encoder and processor loaded once. References keep their alpha (the pipeline
    composites them over white for the VLM); the report's images and scores are RGB."""
    from diffusers import QwenImage21Pipeline

    from features.decode import read_image_file
    from features.pictures import rgb_over_white
    from models.loading import load_component, parse_dtype
    from models.qwen21_generate import pipeline_sample_sigmas
    from models.qwen21_predict import edit_21

    pipe = QwenImage21Pipeline(
        scheduler=load_component(model, "scheduler"), vae=vae, processor=load_component(model, "processor"),
        text_encoder=load_component(model, "text_encoder", dtype=parse_dtype(cfg.dtype), device=cfg.device),
        transformer=transformer, sample_sigmas=pipeline_sample_sigmas(model))
    for i, extra in enumerate(cfg.extra_prompts):
        # decoded as predict decodes them (features.decode: EXIF, CMYK, 16-bit; alpha kept for the 2.1 VAE)
        refs = [read_image_file(p, keep_alpha=True, what=f"evaluate.extra_prompts[{i}] image")
                for p in extra.images]
        target = (read_image_file(extra.target, what=f"evaluate.extra_prompts[{i}] target")
                  if extra.target else None)

        def cond(refs=refs, extra=extra):
            return edit_21(pipe, refs, extra.prompt, cfg.negative_prompt, cfg.num_inference_steps,
                           cfg.true_cfg_scale, cfg.seed, extra.height, extra.width).convert("RGB")

        yield (f"extra {i + 1}", extra.prompt, [rgb_over_white(r) for r in refs], target, cond, extra.height,
               extra.width, dict(pipe.scheduler.config))


def extra_rows_21(model: str, transformer, vae, cfg) -> list:
    """The extra prompts' rows, base (LoRA bypassed) and LoRA, same seed."""
    from stages.evaluate.report import SampleRow
    from stages.evaluate.stage import _scores, lora_enabled

    rows = []
    for title, prompt, refs, target, cond, *_ in tqdm(extra_inputs_21(model, transformer, vae, cfg),
                                                      total=len(cfg.extra_prompts), desc="generate extra prompts"):
        pair = []
        for on in (False, True):
            with lora_enabled(transformer, on):
                pair.append(cond())
        rows.append(SampleRow(title, prompt, refs, target, pair[0], pair[1], _scores(target, pair[0], pair[1])))
    return rows
