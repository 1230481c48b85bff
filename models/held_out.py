"""Held-out losses as one array (evaluate and validation while training both use it): [sample, noise seed, σ, region] for one transformer state (base or a LoRA).

One forward per (sample, seed, σ) row, its squared error weighted three ways: all target tokens, inside the
edit mask (weights = mask) and outside it (1 − mask). The mask weights only enter `per_sample_loss` after the
forward, so the three regions cost one forward pass, not three (what `mask_region_loss` used to run).
A sample without a mask that has both regions non-empty gets NaN inside / outside.

`loss_summary` turns the arrays of base and LoRA into the report's nested numbers (overall, per bucket, per σ,
per sample, mask regions): evaluate's metrics.json, unchanged in shape.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import torch
from tqdm.auto import tqdm

from models.flow import mask_token_weights, per_sample_loss, prepare_flow_batch, target_predictions
from models.multires import _unwrap
from models.randomness import eval_noise
from models.sample import TrainSample
from schemas.img_shapes import PIXELS_PER_PATCH

REGIONS = ("all", "inside", "outside")
MASK_NOTE = (
    "Same protocol, each sample's loss restricted to its edit mask (inside: weights = mask; outside: weights = "
    "1 − mask, normalised per sample), over the samples that have a mask with both regions non-empty."
)


def bucket_of(sample: TrainSample) -> str:
    _, h, w = sample.img_shapes[0]
    return f"{h * PIXELS_PER_PATCH}x{w * PIXELS_PER_PATCH}"


def has_two_regions(sample: TrainSample) -> bool:
    """A mask with some tokens inside and some outside (otherwise one region is empty and has no loss)."""
    if sample.mask_weight is None:
        return False
    mass = float(sample.mask_weight.clamp(0, 1).sum())
    return 0 < mass < sample.mask_weight.numel()


@torch.no_grad()
def loss_grid(transformer, samples: list[TrainSample], seeds: list[int], sigmas: list[float], batch_size: int,
              desc: str = "held-out loss", show: bool = True, load=None, cells: np.ndarray | None = None,
              max_tokens: int | None = None) -> np.ndarray:
    """float64 [len(samples), len(seeds), len(sigmas), 3]: `flow_loss` of every row, regions all/inside/outside.

    Batches of one (seed, σ) cell: the samples go in chunks of `batch_size`, each chunk read once and run at
    every cell in turn, so a row's batch companions are the same samples at the same cell whatever the other
    cells of the grid are: a cell computed alone (`cells`: a [seed, σ] mask of those to compute, the others NaN;
    a grown seed or σ grid computes only its new cells) equals, bit for bit, that cell of a whole grid (rows
    batched across cells depended on their neighbours by float rounding). `show`: its progress bar (one rank's of
    several: off). `load(i)`: sample i in full when `samples` are outlines (key, img_shapes, mask): only the
    samples of one chunk are held, whatever the count. `max_tokens` (training's `train.max_tokens_per_batch`): a
    chunk also holds at most that many computed tokens (count x longest, `chunks`), as a training micro-batch does.
    """
    load = load or samples.__getitem__
    todo = [(k, t) for k in range(len(seeds)) for t in range(len(sigmas)) if cells is None or cells[k, t]]
    out = np.full((len(samples), len(seeds), len(sigmas), len(REGIONS)), np.nan)
    two = [has_two_regions(s) for s in samples]
    base = _unwrap(transformer)
    lengths = [s.sequence_tokens for s in samples] if max_tokens is not None and todo else None
    batches = chunks(len(samples), batch_size, lengths, max_tokens) if todo else []
    bar = tqdm(total=len(batches) * len(todo), desc=desc, unit="batch", leave=False, disable=not show)
    for chunk in batches:
        held = [load(i) for i in chunk]
        masked = [j for j, i in enumerate(chunk) if two[i]]
        for k, t in todo:
            fb = prepare_flow_batch(
                held, torch.full((len(chunk),), float(sigmas[t]), dtype=torch.float32),
                [eval_noise(s, seeds[k]) for s in held], None, (1.0, 1.0), base.device, base.dtype,
            )
            preds = target_predictions(transformer, fb)
            values = [per_sample_loss(preds, fb.targets)]
            for fg, bg in ((1.0, 0.0), (0.0, 1.0)):  # inside, outside
                region = torch.full((len(chunk),), math.nan)
                if masked:
                    w = [mask_token_weights(held[j].mask_weight, fg, bg) for j in masked]
                    region[masked] = per_sample_loss([preds[j] for j in masked], [fb.targets[j] for j in masked],
                                                     w).cpu()
                values.append(region)
            out[chunk, k, t] = torch.stack([v.cpu().double() for v in values], dim=1).numpy()
            bar.update()
        del held
    bar.close()
    return out


def chunks(count: int, batch_size: int, lengths: list[int] | None = None,
           max_tokens: int | None = None) -> list[list[int]]:
    """Rows 0..count-1 in order as consecutive chunks of at most `batch_size`; with `max_tokens` also of a padded
    cost (count x longest of `lengths`) within it, one sample at least (a sample longer than the budget alone).
    Without a budget, or where `batch_size` of them fit, the chunks are the fixed-size ones (the same companions,
    the same numbers); cut by the budget, a row's loss differs from them by float rounding only."""
    out: list[list[int]] = []
    chunk: list[int] = []
    longest = 0
    for i in range(count):
        length = lengths[i] if max_tokens is not None else 0
        if chunk and (len(chunk) == batch_size
                      or (max_tokens is not None and (len(chunk) + 1) * max(longest, length) > max_tokens)):
            out.append(chunk)
            chunk, longest = [], 0
        chunk.append(i)
        longest = max(longest, length)
    if chunk:
        out.append(chunk)
    return out


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def loss_summary(grids: dict[str, np.ndarray], samples: list[TrainSample], seeds: list[int], sigmas: list[float],
                 protocol: str) -> dict:
    """The report's numbers from `loss_grid` arrays named e.g. "base" and "lora": per sample the mean over
    seeds x σ; then overall, per bucket, per σ, per sample, and inside / outside the mask (when any sample has
    two regions). Means run over rows in row order, as the per-row lists did before."""
    names = list(grids)
    per_row = {m: g[..., 0].reshape(-1).tolist() for m, g in grids.items()}  # sample-major rows, region "all"
    per_k = len(seeds) * len(sigmas)

    def summary(picked: list[int]) -> dict:
        n = len({i // per_k for i in picked})
        return {"n": n, **{m: _mean(per_row[m][i] for i in picked) for m in names}}

    by_bucket, by_sigma, by_key = defaultdict(list), defaultdict(list), defaultdict(list)
    for i in range(len(samples) * per_k):
        s = samples[i // per_k]
        by_bucket[bucket_of(s)].append(i)
        by_sigma[float(sigmas[i % len(sigmas)])].append(i)
        by_key[s.key].append(i)
    buckets = sorted(by_bucket, key=lambda b: tuple(int(x) for x in b.split("x")))
    result = {
        "protocol": protocol,
        "noise_seeds": list(seeds),
        "timesteps": list(sigmas),
        "overall": summary(list(range(len(samples) * per_k))),
        "per_bucket": {b: summary(by_bucket[b]) for b in buckets},
        "per_timestep": {str(t): summary(by_sigma[float(t)]) for t in sigmas},
        "per_sample": {s.key: summary(by_key[s.key]) for s in samples},
    }
    masked = [i for i, s in enumerate(samples) if has_two_regions(s)]
    if masked:
        mask: dict = {"note": MASK_NOTE}
        per_sample = {samples[i].key: {"tokens": samples[i].mask_weight.numel(),
                                       "mask_tokens": float(samples[i].mask_weight.clamp(0, 1).sum())} for i in masked}
        for r, region in ((1, "inside"), (2, "outside")):
            mask[region] = {"n": len(masked)}
            for m, g in grids.items():
                mask[region][m] = _mean(g[masked, :, :, r].reshape(-1).tolist())
                for i in masked:
                    per_sample[samples[i].key].setdefault(region, {})[m] = _mean(g[i, :, :, r].reshape(-1).tolist())
        mask["per_sample"] = per_sample
        result["mask"] = mask
    return result
