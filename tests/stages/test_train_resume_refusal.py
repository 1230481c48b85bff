"""What a `--resume` refused for changed settings tells the user: the changed settings by dotted name, old -> new
(at most five, then "and N more"), read from the run folder's train_config.yaml; where that file is gone, that
only a fingerprint is recorded and which file held the settings; and `--new-run` either way."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from stages.train import state as train_state
from stages.train.recipe import run
from stages.train.resume import CONFIG_FILE, changed_settings, shown_changes
from train_store import make_train_store, mixed_specs

BASE = {"train.device": "cpu", "train.lora.rank": 4, "train.batch_size": 2, "train.learning_rate": 2e-3}


def test_shown_changes_lists_five_then_counts_the_rest() -> None:
    changed = [f"train.k{i}: {i} -> {i + 1}" for i in range(8)]
    assert shown_changes(changed).split("\n  ") == [*changed[:5], "and 3 more"]
    assert shown_changes(changed[:5]).split("\n  ") == changed[:5]


def test_changed_settings_reads_the_run_folders_config(tmp_path) -> None:
    (tmp_path / CONFIG_FILE).write_text("train:\n  learning_rate: 0.002\n  lora: {rank: 4}\n  log_every: 1\n")
    now = {"train": {"learning_rate": 0.01, "lora": {"rank": 4}, "log_every": 5}}
    assert changed_settings(tmp_path, now, {"log_every"}) == ["train.learning_rate: 0.002 -> 0.01"]
    assert changed_settings(tmp_path / "gone", now, set()) is None  # no file: nothing to name, not "no change"
    (tmp_path / CONFIG_FILE).write_text("[unclosed")
    assert changed_settings(tmp_path, now, set()) is None


@pytest.fixture
def trained(tiny_edit_model, tmp_path):
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(6))
    run(load_config(None, {**BASE, "train.max_steps": 1}), store, tiny_edit_model, out)
    return store, out


def test_a_changed_learning_rate_is_named_with_the_way_on(trained, tiny_edit_model) -> None:
    store, out = trained
    with pytest.raises(train_state.ResumeMismatch) as refused:
        run(load_config(None, {**BASE, "train.max_steps": 2, "train.learning_rate": 1e-2}), store, tiny_edit_model,
            out, resume=True)
    line = str(refused.value)
    assert "train.learning_rate: 0.002 -> 0.01" in line and "--new-run" in line, line
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [1]


def test_without_the_run_folders_config_the_refusal_says_only_a_fingerprint_is_kept(trained, tiny_edit_model) -> None:
    store, out = trained
    (out / CONFIG_FILE).unlink()
    with pytest.raises(train_state.ResumeMismatch) as refused:
        run(load_config(None, {**BASE, "train.max_steps": 2, "train.learning_rate": 1e-2}), store, tiny_edit_model,
            out, resume=True)
    line = str(refused.value)
    assert "only a fingerprint" in line and str(out / CONFIG_FILE) in line and "--new-run" in line, line
