"""A resume refused for a changed setting lists the changed `train.*` settings to set back. It listed edits to
settings the run does not read too (a σ parameter its sigma.sampling does not read, adam_betas / adam_eps under
Adafactor), which enter the run fingerprint as their defaults: no reason for the refusal, and setting them back
changes nothing."""

from __future__ import annotations

import yaml

from pipeline.config import load_config
from stages.train.resume import changed_settings


def _changed(tmp_path, before: dict, now: dict) -> list[str]:
    (tmp_path / "train_config.yaml").write_text(yaml.safe_dump(load_config(None, before).model_dump(mode="json")))
    return changed_settings(tmp_path, load_config(None, now).model_dump(mode="json"), set())


def test_edits_to_settings_neither_run_reads_are_not_listed(tmp_path):
    before = {"train.learning_rate": 0.002, "train.sigma.sampling": "logit_normal", "train.optimizer": "adafactor"}
    now = {**before, "train.learning_rate": 0.001, "train.sigma.shift": 5.0, "train.sigma.max_shift": 1.2,
           "train.adam_eps": 0.5}
    assert _changed(tmp_path, before, now) == ["train.learning_rate: 0.002 -> 0.001"]


def test_a_setting_read_by_either_run_is_still_listed(tmp_path):
    """sigma.sampling changed: the shift the recorded run read differs too, and must be set back with it."""
    before = {"train.sigma.sampling": "shift", "train.sigma.shift": 5.0, "train.optimizer": "adamw"}
    now = {"train.sigma.sampling": "logit_normal", "train.sigma.shift": 4.0, "train.sigma.logit_std": 1.0,
           "train.optimizer": "adafactor", "train.adam_eps": 0.5}
    assert _changed(tmp_path, before, now) == ["train.adam_eps: 1e-08 -> 0.5", "train.optimizer: 'adamw' -> 'adafactor'",
                                               "train.sigma.sampling: 'shift' -> 'logit_normal'",
                                               "train.sigma.shift: 5.0 -> 4.0"]


def test_an_unreadable_train_config_lists_nothing_and_stops_nothing(tmp_path):
    """Both readers of the run's train_config.yaml (the refusal's list, the up-to-date skip's unapplied settings)
    read it through one parse: a file damaged past reading (bytes that are not UTF-8, YAML that is not a mapping,
    a `train` that is not one) lists nothing, as a missing one does; before, those raised out of the start."""
    from stages.train.resume import unapplied_settings

    now = load_config(None, {}).model_dump(mode="json")
    for damaged in (b"train:\n  learning_rate: 0.002 \xff\xfe\n", b"- a\n- b\n", b"train: 3\n"):
        (tmp_path / "train_config.yaml").write_bytes(damaged)
        assert changed_settings(tmp_path, now, set()) == [] and unapplied_settings(tmp_path, now) == [], damaged
