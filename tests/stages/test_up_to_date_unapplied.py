"""A finished run stays up to date when only settings acting while training change (validate_every, sample_every,
checkpoint cadence: hashed in nothing), so `run all` trains nothing and they produce nothing. The skip's line says
so, naming each one against the run's train_config.yaml, instead of leaving the user to find no validation curve
and no sample grid in the run folder."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from stages.train.recipe import run
from train_store import make_train_store, mixed_specs

BASE = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 2e-3, "train.lora.rank": 4,
        "train.sigma.sampling": "uniform", "train.max_steps": 2, "train.checkpoint_every": 2}


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_edit_model):
    root = tmp_path_factory.mktemp("unapplied") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(6))
    return root


def test_an_up_to_date_skip_names_the_while_training_settings_it_did_not_apply(store_dir, tiny_edit_model, tmp_path):
    out = tmp_path / "run"
    run(load_config(None, BASE), store_dir, tiny_edit_model, out)
    same = run(load_config(None, BASE), store_dir, tiny_edit_model, out, skip_if_done=True)
    assert same.up_to_date and same.unapplied == [] and "not applied" not in str(same)
    asked = load_config(None, {**BASE, "train.validate_every": 1, "train.sample_every": 1})
    skipped = run(asked, store_dir, tiny_edit_model, out, skip_if_done=True)
    assert skipped.up_to_date  # nothing trained: the run folder has no curve and no grids
    assert not (out / "losses.zarr").exists() and not (out / "samples").exists()
    assert skipped.unapplied == ["train.sample_every: None -> 1", "train.validate_every: None -> 1"]
    line = str(skipped)
    assert "not applied, nothing was trained: train.sample_every: None -> 1, train.validate_every: None -> 1" in line
    assert "--new-run" in line
    # a train_config.yaml written before a setting existed names none it does not record
    import yaml

    recorded = yaml.safe_load((out / "train_config.yaml").read_text())
    del recorded["train"]["profile"], recorded["train"]["sample_every"]
    (out / "train_config.yaml").write_text(yaml.safe_dump(recorded))
    older = run(asked, store_dir, tiny_edit_model, out, skip_if_done=True)
    assert older.up_to_date and older.unapplied == ["train.validate_every: None -> 1"]
