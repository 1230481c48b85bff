"""Held-out losses in one forward per row: the three regions (all / inside / outside the mask) equal what three
separate `flow_loss` passes give (evaluate's protocol before: one pass per region with mask token weights)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from models.flow import flow_loss
from models.held_out import has_two_regions, loss_grid
from models.loading import load_component
from models.multires import install_multires
from models.randomness import eval_noise
from lora_writer import add_random_b_lora
from schemas.config import EvaluateConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stages"))
from train_store import make_train_store, mixed_specs, open_split  # noqa: E402


@pytest.fixture(scope="module")
def val_samples(tiny_edit_model, tmp_path_factory):
    from stages.train.data import load

    store = tmp_path_factory.mktemp("store")
    make_train_store(store, tiny_edit_model, mixed_specs(1, 6, masks=True))
    tables = open_split(store, tiny_edit_model, split="val", section="evaluate")
    return [load(tables, k) for k in sorted(tables.keys)]


@pytest.fixture(scope="module")
def transformer(tiny_edit_model):
    t = load_component(tiny_edit_model, "transformer")
    install_multires(t)
    add_random_b_lora(t)
    return t


def _reference(transformer, samples, seeds, sigmas, batch_size, weights):
    """The old path: `flow_loss` with the region's mask weights, in `loss_grid`'s batches (chunks of `batch_size`
    samples, one (seed, σ) cell a forward); the rows in (sample, seed, σ) order."""
    out = {}
    with torch.no_grad():
        for i in range(0, len(samples), batch_size):
            chunk = samples[i : i + batch_size]
            for k in seeds:
                for t in sigmas:
                    losses = flow_loss(transformer, chunk, torch.full((len(chunk),), float(t)),
                                       [eval_noise(s, k) for s in chunk], mask_weight=weights).tolist()
                    out.update({(i + j, k, t): v for j, v in enumerate(losses)})
    return [out[(i, k, t)] for i in range(len(samples)) for k in seeds for t in sigmas]


def test_one_forward_per_row_equals_three_flow_loss_passes(transformer, val_samples):
    seeds, sigmas, bs = [0, 3], [0.25, 0.8], 3
    masked = [s for s in val_samples if has_two_regions(s)]
    assert 0 < len(masked) < len(val_samples)  # both kinds present
    grid = loss_grid(transformer, val_samples, seeds, sigmas, bs)
    assert grid.shape == (len(val_samples), 2, 2, 3)

    everything = _reference(transformer, val_samples, seeds, sigmas, bs, (1.0, 1.0))
    assert grid[..., 0].reshape(-1).tolist() == everything  # same rows, same batches: bit-identical
    for r, weights in ((1, (1.0, 0.0)), (2, (0.0, 1.0))):
        ref = _reference(transformer, masked, seeds, sigmas, bs, weights)  # batches of masked samples only
        mine = [grid[i, k, t, r] for i, s in enumerate(val_samples) if has_two_regions(s)
                for k in range(2) for t in range(2)]
        assert mine == pytest.approx(ref, rel=1e-5, abs=1e-7)
        unmasked = [grid[i, :, :, r] for i, s in enumerate(val_samples) if not has_two_regions(s)]
        assert all(math.isnan(v) for g in unmasked for v in g.reshape(-1))


def test_evaluate_summary_matches_the_three_pass_protocol(transformer, val_samples):
    """`held_out_loss` (evaluate's metrics.json numbers) from the one-forward grid equals the old per-region
    means: overall, per bucket and inside / outside, base and LoRA."""
    from stages.evaluate.loss_section import held_out_loss
    from stages.evaluate.lora_attach import lora_enabled

    cfg = EvaluateConfig(noise_seeds=[0, 1], timesteps=[0.3, 0.7], batch_size=4)
    loss = held_out_loss(transformer, val_samples, cfg)
    masked = [s for s in val_samples if has_two_regions(s)]
    for name, on in (("base", False), ("lora", True)):
        with lora_enabled(transformer, on):
            overall = _reference(transformer, val_samples, [0, 1], [0.3, 0.7], 4, (1.0, 1.0))
            inside = _reference(transformer, masked, [0, 1], [0.3, 0.7], 4, (1.0, 0.0))
            outside = _reference(transformer, masked, [0, 1], [0.3, 0.7], 4, (0.0, 1.0))
        assert loss["overall"][name] == sum(overall) / len(overall)
        assert loss["mask"]["inside"][name] == pytest.approx(sum(inside) / len(inside), rel=1e-6)
        assert loss["mask"]["outside"][name] == pytest.approx(sum(outside) / len(outside), rel=1e-6)
    assert loss["overall"]["lora"] != loss["overall"]["base"]
    assert loss["mask"]["inside"]["n"] == len(masked)
    assert sum(b["n"] for b in loss["per_bucket"].values()) == len(val_samples)
