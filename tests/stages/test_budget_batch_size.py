"""Under a token budget (`train.max_tokens_per_batch`) `train.batch_size` decides no trained number: the budget
sampler ignores it and an elastic resume cuts shares by the budget. So it is not part of the run fingerprint there:
a run killed with one batch_size resumes with another and trains the LoRA a straight run trains (it was refused,
"train config fingerprint ... -> ..."), while a run made before keeps resuming (its fingerprint, which held
batch_size, is still recognised). With fixed-size batches batch_size stays in the fingerprint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from models.lora import read_lora
from pipeline.config import load_config
from schemas import config as C
from stages.train.recipe import run
from stages.train.settings import config_fingerprint, earlier_config_fingerprints
from stages.train.state import ResumeMismatch
from train_store import make_train_store, mixed_specs

BASE = {"train.device": "cpu", "train.learning_rate": 2e-3, "train.lora.rank": 4, "train.sigma.sampling": "uniform"}


def cfg_of(**train):
    return load_config(None, {**BASE, **{f"train.{k}": v for k, v in train.items()}})


def same_lora(a: Path, b: Path) -> bool:
    la, lb = read_lora(a / "lora")[0], read_lora(b / "lora")[0]
    return la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_edit_model):
    root = tmp_path_factory.mktemp("budget-bs") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(8))
    return root


def test_a_token_budget_run_resumes_with_another_batch_size_and_trains_the_straight_lora(store_dir, tiny_edit_model,
                                                                                         tmp_path):
    run(cfg_of(max_tokens_per_batch=80, batch_size=2, max_steps=4, checkpoint_every=4), store_dir, tiny_edit_model,
        tmp_path / "straight")
    run(cfg_of(max_tokens_per_batch=80, batch_size=2, max_steps=2, checkpoint_every=2), store_dir, tiny_edit_model,
        tmp_path / "resumed")
    run(cfg_of(max_tokens_per_batch=80, batch_size=5, max_steps=4, checkpoint_every=4), store_dir, tiny_edit_model,
        tmp_path / "resumed", resume=True)
    assert same_lora(tmp_path / "straight", tmp_path / "resumed")
    # fixed-size batches: batch_size decides the steps, a change is refused naming it
    run(cfg_of(batch_size=2, max_steps=2, checkpoint_every=2), store_dir, tiny_edit_model, tmp_path / "fixed")
    with pytest.raises(ResumeMismatch, match="train.batch_size: 2 -> 3"):
        run(cfg_of(batch_size=3, max_steps=4), store_dir, tiny_edit_model, tmp_path / "fixed", resume=True)


def test_fingerprints_with_batch_size_hashed_under_a_budget_are_still_recognised():
    budget = C.TrainConfig(dtype="float32", max_tokens_per_batch=4096)
    # the values the code computed before (batch_size hashed under a budget): runs made then keep resuming
    assert "ee8764ba4d8aa313" in earlier_config_fingerprints(budget)
    assert "e16036d0e245593c" in earlier_config_fingerprints(budget.model_copy(update={"batch_size": 3}))
    assert config_fingerprint(budget) == config_fingerprint(budget.model_copy(update={"batch_size": 3}))
    fixed = C.TrainConfig(dtype="float32")
    assert config_fingerprint(fixed) != config_fingerprint(fixed.model_copy(update={"batch_size": 3}))
    other = fixed.model_copy(update={"batch_size": 3})  # no spelling of another batch size is this run's
    assert not set(earlier_config_fingerprints(fixed)) & set(earlier_config_fingerprints(other))


def test_a_budget_run_recorded_with_batch_size_hashed_resumes_and_stays_current(store_dir, tiny_edit_model, tmp_path):
    """Its checkpoints hold the earlier fingerprint: resumed with the same settings it continues (and the new
    checkpoints hold today's); a finished one is still up to date for `run all`."""
    from dataclasses import replace

    from stages.train import state as train_state
    from stages.train.current import up_to_date

    def as_made_before(folder: Path, cfg) -> None:
        record = train_state.ResumeRecord.read(folder / train_state.RESUME_JSON)
        from schemas.lineage import hashed_settings, settings_hash

        tc = cfg.train.model_copy(update={"dtype": "float32"})
        # as written then: batch_size and the memory settings hashed
        earlier = settings_hash({**hashed_settings(tc), "batch_size": tc.batch_size, "gradient_checkpointing": False,
                                 "offload": "none", "offload_blocks_on_device": 0})
        assert earlier in earlier_config_fingerprints(tc) and earlier != record.config_fingerprint
        train_state.write_record(folder, replace(record, config_fingerprint=earlier))

    out = tmp_path / "run"
    half = cfg_of(max_tokens_per_batch=80, batch_size=2, max_steps=2, checkpoint_every=2)
    run(half, store_dir, tiny_edit_model, out)
    as_made_before(out / "checkpoints" / "step-2", half)
    full = cfg_of(max_tokens_per_batch=80, batch_size=2, max_steps=3, checkpoint_every=3)
    assert run(full, store_dir, tiny_edit_model, out, resume=True).steps == 3
    as_made_before(out / "checkpoints" / "step-3", full)
    weights = out / "lora" / "pytorch_lora_weights.safetensors"
    os.utime(weights, ns=((out / "checkpoints" / "step-3" / "resume.json").stat().st_mtime_ns,) * 2)  # saved last
    assert up_to_date(full, store_dir, tiny_edit_model, out)
    assert not up_to_date(cfg_of(max_tokens_per_batch=96, batch_size=2, max_steps=3), store_dir, tiny_edit_model, out)


def test_a_budget_resume_with_another_batch_size_keeps_the_validation_curve(tiny_edit_model, tmp_path):
    """batch_size is validation's rows per forward only (as evaluate.batch_size, a throughput setting): a resume
    that may now change it under a budget appends to RUN/losses.zarr, not setting the curve aside and starting over
    (it lost the validations before the last checkpoint from the run's curve)."""
    import xarray as xr

    store_dir = tmp_path / "store"
    make_train_store(store_dir, tiny_edit_model, mixed_specs(4, 2))
    val = {"validate_every": 1, "validate_max_samples": 2, "max_tokens_per_batch": 80}
    out = tmp_path / "run"
    run(cfg_of(batch_size=2, max_steps=2, checkpoint_every=2, **val), store_dir, tiny_edit_model, out)
    run(cfg_of(batch_size=5, max_steps=3, checkpoint_every=3, **val), store_dir, tiny_edit_model, out, resume=True)
    assert list(xr.open_zarr(out / "losses.zarr").step.values) == [1, 2, 3]
    assert sorted(p.name for p in out.glob("losses*.zarr")) == ["losses.zarr"]


def as_earlier_release(validator) -> None:
    """The validation setting as the earlier code spelled it: batch_size hashed under a budget too, and the val
    split's tables named by the version ids read (before the curve named them by content)."""
    from stages.train.val_curve import _fingerprint

    curve = validator.curve
    curve.settings = {**curve.settings, "tables": curve.versions,
                      "validate": {**curve.settings["validate"], "batch_size": validator.cfg.batch_size}}
    curve.fingerprint = _fingerprint(curve.settings)


def test_a_budget_curve_begun_with_batch_size_hashed_is_appended_to(tiny_edit_model, tmp_path, monkeypatch):
    """A run whose losses.zarr was begun when validation hashed batch_size under a budget keeps its curve on
    resume (same batch_size, as the run's own fingerprint requires)."""
    import xarray as xr

    from stages.train.validate import Validator

    store_dir = tmp_path / "store"
    make_train_store(store_dir, tiny_edit_model, mixed_specs(4, 2))
    val = {"validate_every": 1, "validate_max_samples": 2, "max_tokens_per_batch": 80, "batch_size": 2}
    real = Validator.__init__

    def as_before(self, *a, **k):  # the earlier code: batch_size in the validation fingerprint
        real(self, *a, **k)
        as_earlier_release(self)

    out = tmp_path / "run"
    monkeypatch.setattr(Validator, "__init__", as_before)
    run(cfg_of(max_steps=2, checkpoint_every=2, **val), store_dir, tiny_edit_model, out)
    monkeypatch.setattr(Validator, "__init__", real)
    run(cfg_of(max_steps=3, checkpoint_every=3, **val), store_dir, tiny_edit_model, out, resume=True)
    assert list(xr.open_zarr(out / "losses.zarr").step.values) == [1, 2, 3]
    assert sorted(p.name for p in out.glob("losses*.zarr")) == ["losses.zarr"]


def test_a_budget_curve_begun_with_batch_size_hashed_survives_a_later_batch_size_change(tiny_edit_model, tmp_path,
                                                                                        monkeypatch):
    """The curve an earlier spelling began is re-recorded under today's fingerprint when it is adopted, and one
    recorded with another batch_size is adopted too: a later batch_size change under the budget appends to it (it
    kept the earlier fingerprint, so the change set the whole curve aside as `losses.<fp>.zarr`)."""
    import xarray as xr

    from stages.train.validate import Validator
    from store.loss_array import recorded_setting

    store_dir = tmp_path / "store"
    make_train_store(store_dir, tiny_edit_model, mixed_specs(4, 2))
    val = {"validate_every": 1, "validate_max_samples": 2, "max_tokens_per_batch": 80}
    real = Validator.__init__

    def as_before(self, *a, **k):  # the earlier code: batch_size in the validation fingerprint
        real(self, *a, **k)
        as_earlier_release(self)

    for name, first, later in (("same", 2, 2), ("other", 2, 5)):
        out = tmp_path / name
        monkeypatch.setattr(Validator, "__init__", as_before)
        run(cfg_of(max_steps=1, checkpoint_every=1, batch_size=first, **val), store_dir, tiny_edit_model, out)
        monkeypatch.setattr(Validator, "__init__", real)
        run(cfg_of(max_steps=2, checkpoint_every=2, batch_size=later, **val), store_dir, tiny_edit_model, out,
            resume=True)
        assert "batch_size" not in recorded_setting(out)[1]["validate"]  # today's spelling
        run(cfg_of(max_steps=3, checkpoint_every=3, batch_size=later + 1, **val), store_dir, tiny_edit_model, out,
            resume=True)
        assert list(xr.open_zarr(out / "losses.zarr").step.values) == [1, 2, 3], name
        assert sorted(p.name for p in out.glob("losses*.zarr")) == ["losses.zarr"], name
