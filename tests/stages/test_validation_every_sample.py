"""Validation's held-out loss is over real val samples, each at its plain loss.

- Every val sample damaged (train.on_damaged=skip, max_damaged_fraction 1.0 lets all be left out): refused at the
  start with one line, before any step; the first validation divided by 0 samples after the steps before it.
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


def test_every_val_sample_damaged_is_refused_before_any_step(tiny_edit_model, tmp_path) -> None:
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(2, 2))
    for i in (2, 3):  # the val samples
        flip_bit(*sample_byte(store, "vae", key_of(i), "target"), 6)
    cfg = load_config(None, {"train.device": "cpu", "train.lora.rank": 4, "train.max_steps": 2,
                             "train.checkpoint_every": 1, "train.validate_every": 2, "train.on_damaged": "skip",
                             "train.max_damaged_fraction": 1.0})
    with pytest.raises(UserError) as refused:
        run(cfg, store, tiny_edit_model, tmp_path / "run")
    line = str(refused.value)
    assert "every val sample" in line and "2 left out" in line and "turn validation off" in line, line
    assert "\n" not in line
    assert not list((tmp_path / "run").glob("checkpoints/step-*")), "trained before the refusal"


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
