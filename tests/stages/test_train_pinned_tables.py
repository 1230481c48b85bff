"""A training reads the table versions it opened, whatever happens in the store meanwhile: a new encode made
current mid-run (and gc run after it) changes nothing of the run's LoRA; a resume afterwards is refused naming
the store tables, since they are no longer the ones trained on."""

from __future__ import annotations

import pytest
import torch

from models.lora import read_lora
from pipeline.config import load_config
from stages.train import recipe
from stages.train.state import ResumeMismatch
from store.gc import collect
from train_store import make_train_store, mixed_specs

BASE = {"train.device": "cpu", "train.learning_rate": 2e-3, "train.lora.rank": 4, "train.batch_size": 2}


def cfg_of(**train):
    return load_config(None, {**BASE, **{f"train.{k}": v for k, v in train.items()}})


def test_a_new_encode_made_current_mid_run_changes_nothing_of_the_run(tiny_edit_model, tmp_path, monkeypatch):
    store = tmp_path / "store"
    specs = mixed_specs(8)
    make_train_store(store, tiny_edit_model, specs)
    straight = recipe.run(cfg_of(max_steps=6, checkpoint_every=3), store, tiny_edit_model, tmp_path / "straight")

    real_log = recipe.log
    plans = []

    def log_then_encode(r, stats):  # after step 2: other features committed as the current versions, then gc
        real_log(r, stats)
        if r.step == 2:
            make_train_store(store, tiny_edit_model, specs, seed=1)
            plans.append(collect(store, echo=lambda line: None))

    monkeypatch.setattr(recipe, "log", log_then_encode)
    during = recipe.run(cfg_of(max_steps=6, checkpoint_every=3), store, tiny_edit_model, tmp_path / "during")
    monkeypatch.setattr(recipe, "log", real_log)
    a, b = read_lora(straight.lora_dir)[0], read_lora(during.lora_dir)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (plan,) = plans  # the versions trained on were kept for the run's lease only, then are gc's to take
    assert {("text", 1), ("vae", 1)} <= set(plan.leased), plan.leased
    assert {("text", 1), ("vae", 1)}.isdisjoint(collect(store, echo=lambda line: None).keep)

    with pytest.raises(ResumeMismatch, match="store tables"):
        recipe.run(cfg_of(max_steps=9), store, tiny_edit_model, tmp_path / "during", resume=True)
