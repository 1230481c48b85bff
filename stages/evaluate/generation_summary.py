"""metrics.json's `generation` section: how the images were made, what PSNR / SSIM can say, each sample's scores
and their means."""

from __future__ import annotations

from schemas.config import EvaluateConfig
from stages.evaluate.report import SampleRow, score_means


PSNR_SSIM_NOTE = (
    "PSNR/SSIM compare each output with the sample's stored target image. They measure pixel fidelity to one "
    "reference edit, not edit quality: a correct edit that differs from the reference in unedited details "
    "scores low. On the tiny random-init demo model both outputs are noise from an untrained decoder, so "
    "there the numbers only show that the plumbing runs; only the held-out loss says whether training helped."
)


def steps_made(cfg: EvaluateConfig, model: str | None) -> str:
    """The denoising steps the images were made with: a Qwen-Image-2.1 folder that fixes its sampling sigmas
    (model_index.json `sample_sigmas`) is sampled at those, whatever `num_inference_steps` says (as the stock
    pipeline does), and the report says so rather than the unused setting."""
    from models.loading import model_variant
    from models.qwen21_generate import pipeline_sample_sigmas

    if model is not None and model_variant(model) == "qwen-image-2.1" and (sigmas := pipeline_sample_sigmas(model)):
        return (f"{len(sigmas)} Euler steps at the model's own sample_sigmas {sigmas} (its model_index.json; "
                f"evaluate.num_inference_steps = {cfg.num_inference_steps} unused, as in the stock pipeline)")
    return f"{cfg.num_inference_steps} Euler steps (dynamic shift)"


def generation_summary(rows: list[SampleRow], cfg: EvaluateConfig, model: str | None = None) -> dict:
    scored = [r for r in rows if r.scores]
    return {
        "settings": (
            f"{steps_made(cfg, model)}, true CFG {cfg.true_cfg_scale} (negative: the "
            f"stored empty prompt; extra prompts: {cfg.negative_prompt!r}), seed {cfg.seed} for every sample, "
            f"base and LoRA alike; LoRA scale {cfg.lora_scale}"
        ),
        "note": PSNR_SSIM_NOTE,
        "samples": [{"title": r.title, "caption": r.caption, **r.scores} for r in rows],
        **(score_means(rows) if scored else {"mean": {}}),  # "mean_over": finite and identical (infinite PSNR)
    }
