"""A step's checkpoint is written before its validation: a validation that fails (out of memory generating the
sample grid) loses no training. The resume continues from that step, runs the validation due there first, and
trains the LoRA a straight run trains. Before: validation ran first, so its failure lost every step since the
previous checkpoint (up to checkpoint_every)."""

from __future__ import annotations

from pathlib import Path

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


def test_a_sample_grid_cut_short_by_a_full_disk_is_written_again_on_resume(tiny_edit_model, tmp_path, monkeypatch):
    """The grid's PNG is written whole or not at all. Before, it was written in place: a full disk (or a kill)
    mid-write left a truncated step-000002.png, which the resume took for "this step's grid is done" and kept."""
    import errno

    from PIL import Image

    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(5, 2))
    real_save = Image.Image.save

    def disk_full(self, fp, *a, **k):
        target = open(fp, "wb") if isinstance(fp, (str, Path)) else fp
        target.write(b"\x89PNG\r\n\x1a\n cut short")
        if target is not fp:
            target.close()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", disk_full)
    with pytest.raises(UserError, match="disk full"):
        run(load_config(None, {**SETS, "train.max_steps": 4}), store, tiny_edit_model, out)
    monkeypatch.setattr(Image.Image, "save", real_save)
    assert not (out / "samples" / "step-000002.png").exists()
    run(load_config(None, {**SETS, "train.max_steps": 4}), store, tiny_edit_model, out, resume=True)
    Image.open(out / "samples" / "step-000002.png").load()  # whole: written again at the resumed step
