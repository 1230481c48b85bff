"""metrics.json's `loss` section: the held-out loss, the trainer's `flow_loss` over the val samples at fixed noise
seeds x a fixed σ grid, LoRA off (base) and on, one forward per row (`models.held_out.loss_grid`), the samples with
a non-finite loss judged by `evaluate.on_nonfinite`, then the means overall, per bucket, per σ and mask, and the
paired difference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from models.flow import flow_loss
from models.held_out import bucket_of, loss_grid, loss_summary
from models.randomness import eval_noise
from models.sample import TrainSample
from schemas.config import EvaluateConfig
from stages.evaluate.lora_attach import lora_enabled
from stages.evaluate.nonfinite import finite_rows
from stages.evaluate.paired import paired, per_sample


@dataclass
class LossRow:
    """One held-out evaluation point: a sample at one noise seed and one σ."""

    sample: TrainSample
    seed: int
    sigma: float


@torch.no_grad()
def row_losses(transformer, rows: list[LossRow], batch_size: int, mask_weight=(1.0, 1.0), desc: str = "") -> list[float]:
    """`flow_loss` of every row, in mixed-resolution batches of `batch_size` rows."""
    out: list[float] = []
    for i in tqdm(range(0, len(rows), batch_size), desc=desc, unit="batch", leave=False):
        chunk = rows[i : i + batch_size]
        sigmas = torch.tensor([r.sigma for r in chunk], dtype=torch.float32)
        noises = [eval_noise(r.sample, r.seed) for r in chunk]
        out += flow_loss(transformer, [r.sample for r in chunk], sigmas, noises, mask_weight=mask_weight).tolist()
    return out


def finite_samples(samples: list[TrainSample], grids: dict, cfg: EvaluateConfig) -> tuple[list[int], list[str]]:
    """evaluate.on_nonfinite over `loss_grid` arrays named e.g. "base" / "lora": stop naming the samples whose
    held-out loss is NaN/inf in any of them, or (skip) the indices of the samples to keep and the keys left out."""
    per_k = len(cfg.noise_seeds) * len(cfg.timesteps)
    row_keys = [s.key for s in samples for _ in range(per_k)]
    kept_rows, nonfinite = finite_rows(row_keys, {m: g[..., 0].reshape(-1).tolist() for m, g in grids.items()},
                                       cfg.on_nonfinite)
    return sorted({i // per_k for i in kept_rows}), nonfinite


def held_out_loss(transformer, samples: list[TrainSample], cfg: EvaluateConfig,
                  base_cache: tuple | None = None, load=None, recorded: tuple | None = None) -> dict:
    """Base vs LoRA loss: per sample the mean over noise seeds x σ grid; then overall, per bucket, per σ, mask.
    One forward per row and LoRA state, weighted all / inside / outside the mask (`loss_grid`). `base_cache`:
    (report folder, key of every input of the base losses): the base grid reused from there when recorded under
    the key (`stages.evaluate.base_losses`). `recorded`: (folder, settings, LoRA path): both grids kept there, and
    only the (seed, σ) cells no group there holds computed (`stages.evaluate.lora_losses`). `load`: sample i in
    full where `samples` are outlines (`loss_grid`)."""
    from stages.evaluate import base_losses, lora_losses
    from store.loss_array import Axes

    def compute(name: str, cells=None):
        with lora_enabled(transformer, name == "lora"):
            return loss_grid(transformer, samples, *cfg.loss_axes, cfg.batch_size, desc=f"held-out loss ({name})",
                             load=load, cells=cells)

    def check_base(base):  # a non-finite base loss = bad stored features (on_nonfinite=stop names them): stop
        finite_samples(samples, {"base": base}, cfg)  # before the LoRA pass, as --all-checkpoints does

    if recorded is not None:
        axes = Axes([s.key for s in samples], [bucket_of(s) for s in samples], *cfg.loss_axes)
        grids = lora_losses.grids(*recorded, axes, compute, base_cache, check_base)
    else:
        shape = (len(samples), len(cfg.noise_seeds), len(cfg.timesteps), 3)
        base = base_losses.cached(*base_cache, shape, lambda: compute("base")) if base_cache else compute("base")
        grids = {"base": base}
        check_base(grids["base"])
        grids["lora"] = compute("lora")
    kept, nonfinite = finite_samples(samples, grids, cfg)
    result = loss_summary({m: g[kept] for m, g in grids.items()}, [samples[i] for i in kept], *cfg.loss_axes,
                          protocol(cfg, samples))
    result["nonfinite_samples"] = nonfinite  # left out of every mean (evaluate.on_nonfinite=skip)
    # did training help: paired over the val samples (same noise and σ for both), ± its standard error
    result["lora_minus_base"] = paired(per_sample(grids["lora"][kept]), per_sample(grids["base"][kept]))
    return result


def protocol(cfg: EvaluateConfig, samples: list[TrainSample]) -> str:
    return (
        f"flow-matching loss on {len(samples)} val samples x noise seeds {cfg.loss_axes[0]} x σ "
        f"{cfg.loss_axes[1]}; the trainer's flow_loss, LoRA off (base) and on (scale {cfg.lora_scale}); "
        "per sample averaged over its target tokens, then over samples"
    )
