"""Under a token budget (`train.max_tokens_per_batch`) validation's forwards stay within it: `pipeline plan` plans
a training micro-batch at the budget's tokens and no validation forward at all, so a held-out forward of
`train.batch_size` val samples (8 x the longest of them, up to 8 budgets' tokens) could run out of memory where
training fit. The losses are per sample: cut by the budget they are the per-sample forwards' numbers."""

from __future__ import annotations

from math import prod

import numpy as np

import models.held_out as held_out
from models.loading import load_component
from models.multires import install_multires
from pipeline.config import load_config
from stages.train.validate import Validator
from train_store import make_train_store, mixed_specs


def tokens(sample) -> int:
    """The joint sequence the budget counts: image tokens of target and controls + prompt tokens."""
    return sum(prod(s) for s in sample.img_shapes) + int(sample.prompt_embeds.shape[0])


def validator(store, model, run_dir, **train):
    settings = {"train.device": "cpu", "train.validate_every": 1, "train.validate_max_samples": 8,
                "train.validate_timesteps": [0.3, 0.7], **{f"train.{k}": v for k, v in train.items()}}
    return Validator(load_config(None, settings).train, store, model, run_dir)


def test_validation_forwards_hold_at_most_the_token_budget_with_the_per_sample_losses(tiny_edit_model, tmp_path,
                                                                                       monkeypatch):
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(4, 8))
    transformer = load_component(tiny_edit_model, "transformer")
    install_multires(transformer)
    lengths = [tokens(s) for s in validator(store, tiny_edit_model, tmp_path / "probe").samples]
    budget = 2 * max(lengths)  # holds two of the longest val samples; batch_size 8 holds all eight
    assert 8 * max(lengths) > budget

    costs: list[int] = []
    prepare = held_out.prepare_flow_batch

    def counted(held, *args, **kwargs):
        costs.append(len(held) * max(tokens(s) for s in held))  # a padded batch: count x longest
        return prepare(held, *args, **kwargs)

    monkeypatch.setattr(held_out, "prepare_flow_batch", counted)
    budgeted = validator(store, tiny_edit_model, tmp_path / "budget", batch_size=8, max_tokens_per_batch=budget)
    grid = budgeted.grid(transformer)
    assert costs and max(costs) <= budget, (costs, budget)
    assert len(costs) < 2 * len(lengths)  # batched, not one sample a forward (two cells each)

    costs.clear()
    per_sample = validator(store, tiny_edit_model, tmp_path / "one", batch_size=1).grid(transformer)
    assert np.isfinite(grid[..., 0]).all()
    np.testing.assert_allclose(grid, per_sample, rtol=1e-5, atol=1e-7, equal_nan=True)
    # a budget that holds the whole batch_size batch: the forwards (and numbers) of fixed-size batches
    roomy = validator(store, tiny_edit_model, tmp_path / "roomy", batch_size=8, max_tokens_per_batch=8 * max(lengths))
    fixed = validator(store, tiny_edit_model, tmp_path / "fixed", batch_size=8)
    assert np.array_equal(roomy.grid(transformer), fixed.grid(transformer), equal_nan=True)


def test_a_val_sample_longer_than_the_budget_is_refused_at_the_start_as_a_training_one(tiny_edit_model, tmp_path):
    """Training refuses a budget below its longest sample at its start; a val sample over it ran alone at the first
    validation, over the budget (an out-of-memory on a GPU after the steps before it). Now the same refusal,
    naming the val samples and their tokens, before any step; without validation the run trains."""
    import pytest

    from schemas.errors import UserError
    from stages.train.recipe import run
    from train_store import Spec, key_of

    store = tmp_path / "store"
    short, long_val = Spec((8, 8), [], 8), Spec((12, 8), [(8, 12), (8, 8)], 12, "val")  # 24 and 76 tokens
    make_train_store(store, tiny_edit_model, [short] * 4 + [Spec((8, 8), [], 8, "val"), long_val])
    settings = {"train.device": "cpu", "train.lora.rank": 4, "train.max_tokens_per_batch": 40, "train.max_steps": 2,
                "train.checkpoint_every": 1}
    with pytest.raises(UserError) as refused:
        run(load_config(None, {**settings, "train.validate_every": 1}), store, tiny_edit_model, tmp_path / "run")
    line = str(refused.value)
    assert f"{key_of(5)} (76 tokens)" in line and "at least 76" in line and "1 val sample(s)" in line, line
    assert "train.validate_every" in line and "\n" not in line
    assert not list((tmp_path / "run").glob("checkpoints/step-*"))  # no step trained
    assert run(load_config(None, settings), store, tiny_edit_model, tmp_path / "plain").steps == 2
