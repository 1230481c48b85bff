"""A step's checkpoint is written before its validation: a validation that fails (out of memory generating the
sample grid) loses no training. The resume continues from that step, runs the validation due there first, and
trains the LoRA a straight run trains. Before: validation ran first, so its failure lost every step since the
previous checkpoint (up to checkpoint_every)."""

from __future__ import annotations

import pytest
import torch
import xarray as xr
from safetensors.torch import load_file

from pipeline.config import load_config
from schemas.errors import UserError
from stages.train.recipe import run
from stages.train.validate import Validator
from train_store import make_train_store, mixed_specs

SETS = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 5e-3, "train.lora.rank": 4,
        "train.checkpoint_every": 2, "train.validate_every": 2, "train.sample_every": 2, "train.sample_steps": 2,
        "train.sample_count": 1, "train.validate_max_samples": 2}


def run_till_the_grid_fails(store, model: str, out, monkeypatch) -> None:
    """A 4-step training into `out` whose first sample grid (step 2, after its checkpoint) runs out of memory."""
    def out_of_memory(self, transformer):
        raise UserError("validation ran out of memory (test)")

    monkeypatch.setattr(Validator, "samples_grid", out_of_memory)
    with pytest.raises(UserError, match="out of memory"):
        run(load_config(None, {**SETS, "train.max_steps": 4}), store, model, out)


def test_a_failed_validation_loses_no_training(tiny_edit_model, tmp_path, monkeypatch):
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(5, 2))
    straight = tmp_path / "straight"
    run(load_config(None, {**SETS, "train.max_steps": 4}), store, tiny_edit_model, straight)

    real = Validator.samples_grid
    out = tmp_path / "run"
    run_till_the_grid_fails(store, tiny_edit_model, out, monkeypatch)
    assert (out / "checkpoints" / "step-2").is_dir()  # the step's training was kept
    monkeypatch.setattr(Validator, "samples_grid", real)
    result = run(load_config(None, {**SETS, "train.max_steps": 4}), store, tiny_edit_model, out, resume=True)
    assert result.start_step == 2
    assert (out / "samples" / "step-000002.png").is_file()  # the validation due at the resumed step ran
    assert list(xr.open_zarr(out / "losses.zarr").step.values) == [2, 4]
    a = load_file(straight / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(out / "lora" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_does_not_repeat_a_validation_that_completed(tiny_edit_model, tmp_path, monkeypatch):
    """A run stopped after its step's checkpoint and validation both completed (a preempted job) resumes without
    validating that step again: its losses and sample grid are there (on a large model a grid is minutes of
    generation, at every resume)."""
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(5, 2))
    out = tmp_path / "run"
    run(load_config(None, {**SETS, "train.max_steps": 2}), store, tiny_edit_model, out)
    grids, real = [], Validator.samples_grid

    def counted(self, transformer):
        grids.append(1)
        return real(self, transformer)

    monkeypatch.setattr(Validator, "samples_grid", counted)
    run(load_config(None, {**SETS, "train.max_steps": 4}), store, tiny_edit_model, out, resume=True)
    assert len(grids) == 1  # step 4's only
    assert list(xr.open_zarr(out / "losses.zarr").step.values) == [2, 4]
