"""Validation's and evaluate's held-out loss is over real val samples, each at its plain loss.

- Every val sample damaged (on_damaged=skip, max_damaged_fraction 1.0 lets all be left out): refused where they
  are read, one line (`features.damaged.check_some_intact`). Before, the validator's first validation divided by
  0 samples after the steps before it; evaluate reported a NaN loss "on 0 val samples" and exited 0, and
  `--all-checkpoints` said no checkpoint had a finite loss, blaming the run's training loss.
- A val sample whose edit mask is empty counts at its plain loss: the held-out figure weighs every target token
  alike (`models.held_out.loss_grid`, region "all"), train.loss.mask_weight does not enter it, so a sample that
  training leaves out of its step's mean (every token weighing 0 with background 0) is no loss of 0 here."""

from __future__ import annotations

import numpy as np
import pytest

from damage import flip_bit, sample_byte
from models.loading import load_component
from models.multires import install_multires
from pipeline.config import load_config
from schemas.errors import UserError
from stages.train.recipe import run
from stages.train.validate import Validator, mean_loss
from train_store import key_of, make_train_store, mixed_specs


def damaged_val_store(tmp_path, model):
    """2 train samples and 2 val samples, both val samples damaged."""
    store = tmp_path / "store"
    make_train_store(store, model, mixed_specs(2, 2))
    for i in (2, 3):
        flip_bit(*sample_byte(store, "vae", key_of(i), "target"), 6)
    return store


def refused_line(refused) -> str:
    line = str(refused.value)
    assert "every 'val' sample read" in line and "2 left out" in line and "store repair" in line, line
    assert "\n" not in line
    return line


def test_every_val_sample_damaged_is_refused_before_any_step(tiny_edit_model, tmp_path) -> None:
    store = damaged_val_store(tmp_path, tiny_edit_model)
    cfg = load_config(None, {"train.device": "cpu", "train.lora.rank": 4, "train.max_steps": 2,
                             "train.checkpoint_every": 1, "train.validate_every": 2, "train.on_damaged": "skip",
                             "train.max_damaged_fraction": 1.0})
    with pytest.raises(UserError) as refused:
        run(cfg, store, tiny_edit_model, tmp_path / "run")
    assert "train.on_damaged=skip" in refused_line(refused) and "turn validation off" in str(refused.value)
    assert not list((tmp_path / "run").glob("checkpoints/step-*")), "trained before the refusal"


def test_evaluate_refuses_when_every_val_sample_is_damaged(tiny_edit_model, tmp_path) -> None:
    """Both readers: one process's (`read_val_samples`) and the ranks' shares (`read_share`, one rank here)."""
    from stages.evaluate.ranks import Ranks
    from stages.evaluate.val_samples import read_val_samples
    from stages.evaluate.val_share import read_share

    store = damaged_val_store(tmp_path, tiny_edit_model)
    cfg = load_config(None, {"evaluate.device": "cpu", "evaluate.on_damaged": "skip",
                             "evaluate.max_damaged_fraction": 1.0}).evaluate
    for read in (lambda: read_val_samples(cfg, store, tiny_edit_model),
                 lambda: read_share(cfg, store, tiny_edit_model, Ranks())):
        with pytest.raises(UserError) as refused:
            tables, _ = read()
            tables.close()
        assert "evaluate.on_damaged=skip" in refused_line(refused)


def test_an_empty_mask_val_sample_counts_at_its_plain_loss(tiny_edit_model, tmp_path) -> None:
    transformer = load_component(tiny_edit_model, "transformer")
    install_multires(transformer)
    figures = {}
    for empty in (False, True):
        store = tmp_path / f"store-{empty}"
        specs = mixed_specs(1, 3)
        for s in specs[1:]:
            s.mask = True
        specs[2].empty_mask = empty
        make_train_store(store, tiny_edit_model, specs)
        settings = {"train.device": "cpu", "train.validate_every": 1, "train.validate_timesteps": [0.5],
                    "train.loss.mask_weight.background": 0.0}
        v = Validator(load_config(None, settings).train, store, tiny_edit_model, tmp_path / f"run-{empty}")
        figures[empty] = v.grid(transformer)
        row = [s.key for s in v.samples].index(key_of(2))  # the val split's rows are in key order
    plain, emptied = figures[False], figures[True]
    assert emptied[row, ..., 0].min() > 0  # the empty-mask sample: its plain loss, not 0
    assert np.isnan(emptied[row, ..., 1:]).all()  # no inside / outside: left out of the mask regions' means
    np.testing.assert_array_equal(emptied[..., 0], plain[..., 0])  # the same figure as with its mask non-empty
    assert mean_loss(emptied) == mean_loss(plain)
