"""dynamic_shift's settings read from the model's scheduler config are checked as the config's own are."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import models.loading
from pipeline.config import ConfigError, load_config
from schemas.errors import UserError
from stages.train.settings import sigma_for_model

_DYNAMIC = {"train.sigma.sampling": "dynamic_shift"}


def _scheduler(monkeypatch, tmp_path, **numbers):
    config = {"base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096, **numbers}
    monkeypatch.setattr(models.loading, "load_component", lambda model, component: SimpleNamespace(config=config))
    monkeypatch.setattr(models.loading, "resolve_model", lambda model: tmp_path / "model")


def test_equal_sequence_lengths_from_the_scheduler_are_refused_in_one_line(monkeypatch, tmp_path):
    """Before: accepted, and train's first step stopped on calculate_shift's ZeroDivisionError."""
    _scheduler(monkeypatch, tmp_path, base_image_seq_len=4096)
    with pytest.raises(UserError) as e:
        sigma_for_model(load_config(None, _DYNAMIC), "m")
    line = str(e.value)
    assert "\n" not in line and str(tmp_path / "model" / "scheduler" / "scheduler_config.json") in line
    assert "base_image_seq_len 4096" in line and "set train.sigma." in line


def test_one_set_one_read_that_meet_are_refused_and_sound_ones_resolve(monkeypatch, tmp_path):
    _scheduler(monkeypatch, tmp_path)
    with pytest.raises(UserError, match="max_image_seq_len 4096 read from"):
        sigma_for_model(load_config(None, {**_DYNAMIC, "train.sigma.base_image_seq_len": 4096}), "m")
    sigma = sigma_for_model(load_config(None, _DYNAMIC), "m").train.sigma
    assert (sigma.base_image_seq_len, sigma.max_image_seq_len, sigma.max_shift) == (256, 4096, 1.15)


def test_equal_sequence_lengths_in_the_config_are_refused_at_load():
    with pytest.raises(ConfigError, match="max_image_seq_len"):
        load_config(None, {**_DYNAMIC, "train.sigma.base_image_seq_len": 512, "train.sigma.max_image_seq_len": 512})
    load_config(None, {"train.sigma.base_image_seq_len": 512, "train.sigma.max_image_seq_len": 512})  # unread
