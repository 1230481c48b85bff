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
    from diffusers import FlowMatchEulerDiscreteScheduler

    from models.qwen21_generate import generate_21

    _, h, w = s.img_shapes[0]  # latent tokens of 16 px
    image = generate_21(transformer, vae, FlowMatchEulerDiscreteScheduler.from_config(scheduler_config),
                        s.prompt_embeds, s.slot_mask, list(s.controls), h * 16, w * 16, cfg.num_inference_steps,
                        cfg.seed, cfg.true_cfg_scale, (s.empty_embeds, s.empty_slot_mask))
    return image.convert("RGB")
