"""A step's numbers count the samples it trains on only: a zero-weight stand-in (a share all damaged,
train.on_damaged=skip; an empty share after an elastic resume runs the same `prepare_share` stand-in) is not
counted in the gradient's denominator, the logged step loss or the non-finite step's loss table, nor is a sample
whose token weights are all 0 (train.loss.mask_weight background 0 and an empty edit mask). One process, the tiny
model and its LoRA in float64, one step of 4 micro-batches of 1 sample, one of them left out: the step's logged
loss and the LoRA gradient the optimizer was given must be those of the mean over the 3 others, each run alone."""

from __future__ import annotations

import torch

from damage import flip_bit, sample_byte
from models.flow import flow_loss_of
from models.lora import lora_parameters
from pipeline.config import load_config
from stages.train import recipe
from stages.train.build import setup_transformer
from stages.train.prefetch import prepare
from train_store import key_of, make_train_store, mixed_specs, open_split

ACCUM = 4
TRAIN = {"train.device": "cpu", "train.lora.rank": 4, "train.batch_size": 1, "train.grad_accum": ACCUM,
         "train.max_steps": 1, "train.sigma.sampling": "uniform", "train.learning_rate": 1e-3}


def _recorded_step(monkeypatch, cfg, store, model, out) -> dict:
    """Run one step in float64, recording its StepStats, the gradients before clipping and the loss table a
    non-finite step would name its samples by (`step_sample_losses`)."""
    seen: dict = {}
    real_setup, real_clip, real_log, real_accumulate = recipe.setup_transformer, recipe._clip, recipe.log, recipe._accumulate

    def accumulate_recording(r, t0):
        got = real_accumulate(r, t0)
        seen["micro"], seen["step_losses"] = got[0], got[-1]
        return got

    def clip_recording(params, max_norm):
        seen["grads"] = [p.grad.detach().clone() for p in params]
        return real_clip(params, max_norm)

    def log_recording(r, stats):
        seen["stats"] = stats
        seen["table"] = recipe.step_sample_losses(r, seen["micro"], seen["step_losses"])
        return real_log(r, stats)

    monkeypatch.setattr(recipe, "setup_transformer", lambda *a, **k: real_setup(*a, **k).to(torch.float64))
    monkeypatch.setattr(recipe, "_clip", clip_recording)
    monkeypatch.setattr(recipe, "log", log_recording)
    monkeypatch.setattr(recipe, "_accumulate", accumulate_recording)
    recipe.run(cfg, store, model, out)
    return seen


def _reference(cfg, store, model, keys: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The samples' losses, each run alone (step 0's draws), their mean and its LoRA gradient."""
    tables = open_split(store, model)
    try:
        samples = [tables.keys.array.to_pylist().index(k) for k in keys]
        transformer = setup_transformer(model, cfg, torch.device("cpu")).to(torch.float64)
        losses = torch.cat([flow_loss_of(transformer, prepare(tables, cfg, [i], 0, torch.device("cpu"), torch.float64))
                            for i in samples])
    finally:
        tables.close()
    mean = losses.mean()
    mean.backward()
    return losses.detach(), mean.detach(), [p.grad for p in lora_parameters(transformer)]


def test_a_stand_in_is_not_counted_in_the_step_mean(tiny_edit_model, tmp_path, monkeypatch) -> None:
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(ACCUM))
    bad = key_of(1)
    flip_bit(*sample_byte(store, "vae", bad, "target"), 6)
    cfg = load_config(None, {**TRAIN, "train.on_damaged": "skip", "train.max_damaged_fraction": 0.5})
    seen = _recorded_step(monkeypatch, cfg, store, tiny_edit_model, tmp_path / "run")

    stats = seen["stats"]
    assert stats.samples == ACCUM - 1  # the stand-in is not a sample of the step
    intact = [key_of(i) for i in range(ACCUM) if key_of(i) != bad]  # the epoch's 4 batches of 1 are the step
    losses, mean, want = _reference(cfg.train, store, tiny_edit_model, intact)
    assert abs(stats.loss - mean.item()) <= 1e-6 * mean.item(), (stats.loss, mean.item())  # float32 sums
    scale = max(g.abs().max().item() for g in want)
    worst = max((g - w).abs().max().item() for g, w in zip(seen["grads"], want))
    assert worst <= 1e-6 * scale, (worst, scale)  # a stand-in counted would be 25% off
    table = seen["table"]  # the stand-in's row is in no slot; the damaged sample's slot is left out
    assert sorted(table) == sorted(intact), table
    assert all(abs(table[k] - v) <= 1e-6 * v for k, v in zip(intact, losses.tolist())), (table, losses)


def test_a_sample_of_zero_weight_is_not_counted_in_the_step_mean(tiny_edit_model, tmp_path, monkeypatch) -> None:
    """Background 0 trains on the edited region only: a sample whose mask is empty trains on nothing (its loss is 0
    and so is its gradient), and the step is the mean over the others. Before, it counted as a sample of loss 0:
    the logged loss and the gradient were 3/4 of the mean over the samples trained on."""
    store = tmp_path / "store"
    specs = mixed_specs(ACCUM)
    specs[1].mask = specs[1].empty_mask = True
    specs[2].mask = True  # half its tokens weigh 0: a sample trained on
    make_train_store(store, tiny_edit_model, specs)
    cfg = load_config(None, {**TRAIN, "train.loss.mask_weight.background": 0.0})
    seen = _recorded_step(monkeypatch, cfg, store, tiny_edit_model, tmp_path / "run")

    stats = seen["stats"]
    trained = [key_of(i) for i in range(ACCUM) if i != 1]
    losses, mean, want = _reference(cfg.train, store, tiny_edit_model, trained)
    assert abs(stats.loss - mean.item()) <= 1e-6 * mean.item(), (stats.loss, mean.item())  # float32 sums
    scale = max(g.abs().max().item() for g in want)
    worst = max((g - w).abs().max().item() for g, w in zip(seen["grads"], want))
    assert worst <= 1e-6 * scale, (worst, scale)


def test_a_step_of_zero_weight_samples_only_updates_nothing(tiny_edit_model, tmp_path) -> None:
    """A step whose only sample weighs 0 in every token trains on nothing: no optimizer update (its LoRA is the
    step before's, bit for bit: Adam's momentum moved it on a zero gradient before) and its loss nan, left out of
    train/loss and the epoch's mean (it was 0.0, averaged in)."""
    import math

    from models.lora import read_lora

    store = tmp_path / "store"
    specs = mixed_specs(4)
    specs[1].mask = specs[1].empty_mask = True
    make_train_store(store, tiny_edit_model, specs)
    cfg = load_config(None, {**TRAIN, "train.grad_accum": 1, "train.max_steps": 4, "train.checkpoint_every": 1,
                             "train.loss.mask_weight.background": 0.0})
    result = recipe.run(cfg, store, tiny_edit_model, tmp_path / "run")
    (k,) = [i + 1 for i, v in enumerate(result.losses) if not math.isfinite(v)]  # the step of sample 1
    assert k > 1 and all(v > 0 for v in result.losses if math.isfinite(v)), result.losses
    before, after = (read_lora(tmp_path / "run" / "checkpoints" / f"step-{s}" / "lora")[0] for s in (k - 1, k))
    assert all(torch.equal(before[n], after[n]) for n in before)
