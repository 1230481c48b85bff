"""Evaluate's sample images: which val samples are pictured, their stored features as the denoiser's inputs and
the extra prompts' through predict's path, each made with the LoRA off and on at the same seed (kept columns
reused, `checkpoint_report`) and scored against its target."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from PIL import Image

from features.decode import read_image_file
from models.generate import Conditioning
from models.held_out import bucket_of
from models.loading import load_component, parse_dtype
from models.precision import check_loaded_dtype
from models.qwen21_flow import is_qwen21
from models.sample import TrainSample
from schemas.config import EvaluateConfig
from stages.evaluate.report import SampleRow, psnr, ssim
from stages.evaluate.report_inputs import read_inputs


def pick_samples(samples: list[TrainSample], n: int) -> list[TrainSample]:
    """n samples, round-robin over buckets (so every resolution shows up), keys sorted within a bucket."""
    by_bucket: dict[str, list[TrainSample]] = defaultdict(list)
    for s in sorted(samples, key=lambda s: s.key):
        by_bucket[bucket_of(s)].append(s)
    queues = [by_bucket[b] for b in sorted(by_bucket)]
    picked: list[TrainSample] = []
    while len(picked) < n and any(queues):
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop(0))
    return picked


def conditioning(sample: TrainSample, device, dtype: torch.dtype) -> Conditioning:
    """Stored features as the denoiser's inputs: batch of one, the stored empty prompt as the CFG negative."""
    def f(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)[None]

    return Conditioning(
        prompt_embeds=f(sample.prompt_embeds),
        control_latents=[f(c) for c in sample.controls],
        negative_embeds=f(sample.empty_embeds),
    )


def _scores(target: Image.Image | None, base: Image.Image, lora: Image.Image) -> dict[str, float]:
    if target is None:
        return {}
    return {"psnr_base": psnr(target, base), "psnr_lora": psnr(target, lora),
            "ssim_base": ssim(target, base), "ssim_lora": ssim(target, lora)}


def extra_prompt_inputs(model: str, transformer, vae, cfg: EvaluateConfig):
    """Each configured extra prompt through predict's stock-equivalent path (text encoder loaded once):
    (title, prompt, controls, target, conditioning, height, width, scheduler config)."""
    from models.edit import load_pipeline, prepare

    pipe = load_pipeline(model, parse_dtype(cfg.dtype), {"text_encoder": cfg.device},
                         transformer=transformer, vae=vae)
    for i, extra in enumerate(cfg.extra_prompts):
        # decoded as resize-bucket decodes the training pictures (EXIF, alpha over white, CMYK, 16-bit)
        controls = [read_image_file(p, what=f"evaluate.extra_prompts[{i}] image") for p in extra.images]
        target = (read_image_file(extra.target, what=f"evaluate.extra_prompts[{i}] target")
                  if extra.target else None)
        cond, height, width = prepare(pipe, controls, extra.prompt, cfg.negative_prompt, cfg.true_cfg_scale,
                                      extra.height, extra.width)
        yield f"extra {i + 1}", extra.prompt, controls, target, cond, height, width, dict(pipe.scheduler.config)


def paired_rows(jobs: list, transformer, vae, cfg: EvaluateConfig, qwen21: bool, samples: list | None = None,
                base_cache: tuple | None = None, lora_cache: tuple | None = None) -> list[SampleRow]:
    """Each job's base image (LoRA bypassed; reused from `base_cache` when every input of it is unchanged: the
    mechanism --all-checkpoints uses, `checkpoint_report.base_column`) and LoRA image (reused alike from
    `lora_cache` = (folder, `base_images.lora_group_key`)), same seed, scored against its target. `samples`: the
    val samples the jobs were picked from (the cache key names them)."""
    from stages.evaluate.checkpoint_report import base_column, kept_column

    base = base_column(jobs, transformer, vae, cfg, qwen21, samples or [], base_cache, lora_off=True)
    lora = kept_column(jobs, transformer, vae, cfg, qwen21, samples or [], lora_cache, "lora")
    return [SampleRow(j.title, j.caption, j.controls, j.target, b, l, _scores(j.target, b, l))
            for j, b, l in zip(jobs, base, lora)]


def sample_rows(cfg: EvaluateConfig, store: str | Path, model: str, transformer, tables, samples: list,
                damaged: dict, out: Path | None = None, lora_sha256: str | None = None) -> list[SampleRow]:
    """Base and LoRA images of `num_samples` val samples (with their stored target and controls) and of the
    extra prompts: the VAE and the scheduler are loaded only here. The base column is kept in OUT/base-images/
    and reused by a rerun whose every input of it is unchanged (`stages.evaluate.base_images`), and the LoRA's
    (of `lora_sha256`) in OUT/lora-images/ alike: a rerun for the loss grid alone generates no image."""
    from stages.evaluate.base_images import FOLDER, LORA_FOLDER, lora_group_key
    from stages.evaluate.checkpoint_report import _jobs

    vae = load_component(model, "vae", dtype=parse_dtype(cfg.dtype), device=cfg.device)
    check_loaded_dtype(vae, cfg.dtype, "evaluate.dtype")
    qwen21 = is_qwen21(transformer)
    jobs = _jobs(cfg, model, store, tables, transformer, vae, samples, damaged, qwen21)
    features = read_inputs(cfg, store, model, tables) if out is not None else None
    cache = (Path(out) / FOLDER, features) if out is not None else None
    lora_cache = (Path(out) / LORA_FOLDER, lora_group_key(cfg, features, lora_sha256)) \
        if out is not None and lora_sha256 is not None else None
    return paired_rows(jobs, transformer, vae, cfg, qwen21, samples, cache, lora_cache)
