"""The token-budget sampler shuffles by numpy for runs started now and by Python's random.shuffle for runs started
before (stages/train/budget.py: ~0.7 s a plan at 1M samples, every epoch and rank): a run's checkpoints record which
(`ResumeRecord.plan_shuffle`), and a resume goes on with its own. A run begun by the earlier code (its records hold no
plan_shuffle) resumes into the LoRA its straight run trains, and so does one begun now."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from models.lora import read_lora
from pipeline.config import load_config
from stages.train import build
from stages.train import state as train_state
from stages.train.budget import PLAN_SHUFFLE, PYTHON_SHUFFLE
from stages.train.recipe import run
from store.checksum import seal
from train_store import make_train_store, mixed_specs

BASE = {"train.device": "cpu", "train.learning_rate": 2e-3, "train.lora.rank": 4, "train.sigma.sampling": "uniform",
        "train.max_tokens_per_batch": 80, "train.checkpoint_every": 2}


def cfg_of(steps: int):
    return load_config(None, {**BASE, "train.max_steps": steps})


def same_lora(a: Path, b: Path) -> bool:
    la, lb = read_lora(a / "lora")[0], read_lora(b / "lora")[0]
    return la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)


def shuffles(out: Path) -> list[int | None]:
    return [train_state.ResumeRecord.read(folder / train_state.RESUME_JSON).plan_shuffle
            for _, folder in train_state.complete_checkpoints(out / "checkpoints")]


def as_written_before(out: Path) -> None:
    """The run's checkpoint records as the earlier code wrote them: no plan_shuffle (resealed)."""
    for _, folder in train_state.complete_checkpoints(out / "checkpoints"):
        record = asdict(train_state.ResumeRecord.read(folder / train_state.RESUME_JSON))
        del record["plan_shuffle"]
        (folder / train_state.RESUME_JSON).write_bytes(seal({**record, "files": train_state.file_checksums(folder)}))


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_edit_model):
    root = tmp_path_factory.mktemp("budget-shuffle") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(8))
    return root


def test_a_run_resumes_with_the_shuffles_it_started_with(store_dir, tiny_edit_model, tmp_path, monkeypatch) -> None:
    with monkeypatch.context() as earlier:  # the earlier code: Python's shuffles for every run
        earlier.setattr(build, "PLAN_SHUFFLE", PYTHON_SHUFFLE)
        run(cfg_of(4), store_dir, tiny_edit_model, tmp_path / "straight-before")
        run(cfg_of(2), store_dir, tiny_edit_model, tmp_path / "before")
    as_written_before(tmp_path / "before")
    assert shuffles(tmp_path / "before") == [None]
    run(cfg_of(4), store_dir, tiny_edit_model, tmp_path / "straight-now")
    # the order decides the weights here: a resume with the other shuffles would not train the straight run's LoRA
    assert not same_lora(tmp_path / "straight-before", tmp_path / "straight-now")
    assert shuffles(tmp_path / "straight-now") == [PLAN_SHUFFLE, PLAN_SHUFFLE]

    assert run(cfg_of(4), store_dir, tiny_edit_model, tmp_path / "before", resume=True).steps == 4
    assert same_lora(tmp_path / "before", tmp_path / "straight-before")
    assert shuffles(tmp_path / "before") == [None, PYTHON_SHUFFLE]  # and its next resume goes on with them

    run(cfg_of(2), store_dir, tiny_edit_model, tmp_path / "now")
    assert run(cfg_of(4), store_dir, tiny_edit_model, tmp_path / "now", resume=True).steps == 4
    assert same_lora(tmp_path / "now", tmp_path / "straight-now")
    assert shuffles(tmp_path / "now") == [PLAN_SHUFFLE, PLAN_SHUFFLE]
