"""evaluate's val-sample images for a Qwen-Image-2.1 model: base and LoRA images of each picked val sample,
generated from its stored features (`models.qwen21_generate`, the stock pipeline's loop), with the stored empty
prompt (same references) as the true-CFG negative when `evaluate.true_cfg_scale` > 1."""

from __future__ import annotations

from tqdm.auto import tqdm


def val_rows_21(transformer, vae, scheduler_config: dict, samples, images, cfg, damaged=None) -> list:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from models.qwen21_generate import generate_21
    from stages.evaluate.report import SampleRow
    from stages.evaluate.stage import _png, _scores, lora_enabled
    from store.integrity import DamagedData

    rows = []
    for s in tqdm(samples, desc="generate val samples"):
        _, h, w = s.img_shapes[0]  # latent tokens of 16 px
        pair = []
        for on in (False, True):
            with lora_enabled(transformer, on):
                image = generate_21(transformer, vae, FlowMatchEulerDiscreteScheduler.from_config(scheduler_config),
                                    s.prompt_embeds, s.slot_mask, list(s.controls), h * 16, w * 16,
                                    cfg.num_inference_steps, cfg.seed, cfg.true_cfg_scale,
                                    (s.empty_embeds, s.empty_slot_mask))
            pair.append(image.convert("RGB"))  # the report and its scores are RGB
        try:
            files = images.files(s.key) if images is not None and s.key in images else {}
        except DamagedData as e:
            if cfg.on_damaged != "skip" or damaged is None:
                raise
            damaged[f"images:{s.key}"] = str(e)
            files = {}
        meta = images.meta(s.key) if images is not None and s.key in images else {}
        target = _png(files["target.png"]) if "target.png" in files else None
        controls = [_png(files[f"control_{i}.png"]) for i in range(len(s.controls)) if f"control_{i}.png" in files]
        rows.append(SampleRow(s.key[:12], str(meta.get("caption", "")), controls, target, pair[0], pair[1],
                              _scores(target, pair[0], pair[1])))
    return rows
