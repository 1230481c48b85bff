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


def test_run_all_refuses_a_scheduler_shift_train_would_refuse_before_any_stage(tiny_plus_model, tmp_path):
    """`run all` resolves dynamic_shift's unset settings from the model's scheduler as train does, before
    resize-bucket: before, the same line came only when train started, after both encoders had run."""
    import json
    import shutil

    import yaml
    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.demo_data import make_demo_data

    model = tmp_path / "model"
    shutil.copytree(tiny_plus_model, model)
    conf = model / "scheduler" / "scheduler_config.json"
    conf.write_text(json.dumps({**json.loads(conf.read_text()), "base_image_seq_len": 8192}))
    source, store = tmp_path / "src", tmp_path / "store"
    make_demo_data(source, n=4, seed=0)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"source": str(source), "store": str(store), "model": str(model),
                                                "run": str(tmp_path / "run"), "report": str(tmp_path / "report")},
                                      "resize": {"val_fraction": 0.5},  # before: the encoders ran, train refused
                                      "train": {"sigma": {"sampling": "dynamic_shift"}}}))
    r = CliRunner().invoke(app, ["run", "all", "--config", str(config)])
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 1 and len(lines) == 1 and "Traceback" not in r.output, r.output
    assert lines[0].startswith("error: train.sigma (dynamic_shift): ") and str(conf) in lines[0], lines[0]
    assert "base_image_seq_len 8192" in lines[0] and "max_image_seq_len 8192" in lines[0], lines[0]
    assert not store.exists() and not (tmp_path / "run").exists()  # nothing resized, encoded or trained


def test_train_start_reads_the_scheduler_once_for_both_uses(monkeypatch, tmp_path, capsys):
    """Train's start read the model's scheduler twice (each read builds the diffusers scheduler): once to resolve
    the shift settings left unset (`sigma_for_model`), once for the note on those set otherwise (`say_other_shift`).
    Now one read serves both: the same numbers resolved, the same note."""
    from stages.train import recipe

    reads, stopped = [], []
    config = {"base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}
    monkeypatch.setattr(models.loading, "load_component",
                        lambda model, component: reads.append(component) or SimpleNamespace(config=config))

    class Stop(Exception):
        pass

    def stop(tc, *a):  # the run folder's lock: the start is over, nothing else is needed here
        stopped.append(tc.sigma)
        raise Stop

    monkeypatch.setattr(recipe, "_lock_run_folder", stop)
    cfg = load_config(None, {**_DYNAMIC, "train.device": "cpu", "train.sigma.max_shift": 0.9})
    with pytest.raises(Stop):
        recipe.run(cfg, tmp_path / "store", "m", tmp_path / "run")
    assert reads == ["scheduler"]
    [sigma] = stopped
    assert (sigma.base_shift, sigma.max_shift, sigma.base_image_seq_len, sigma.max_image_seq_len) == (0.5, 0.9, 256, 4096)
    [note] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: train.sigma")]
    assert "max_shift 0.9, as set" in note and "max_shift 1.15" in note, note
