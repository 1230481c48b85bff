"""`pipeline run all` refuses, before its first stage, a train setting that train would refuse after
resize-bucket and both encoders (hours at a million samples), by train's own check. Before: with
`train.control_dropout > 0` and encode-text run without `encode_text.no_control_embeds`, resize-bucket, encode-text
and encode-vae ran (every encoder loaded), then train refused the text table it opened."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

import models.loading
from pipeline.cli import app
from pipeline.demo_data import make_demo_data


def _run_all(tmp_path, model: str, *sets: str):
    source = tmp_path / "src"
    make_demo_data(source, n=4, seed=0)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "paths": {"source": str(source), "store": str(tmp_path / "store"), "model": model,
                  "run": str(tmp_path / "run"), "report": str(tmp_path / "report")},
        "resize": {"target_area": 64 * 64, "control_vae_area": 64 * 64, "val_fraction": 0.5},
        "train": {"max_steps": 1}}))
    return CliRunner().invoke(app, ["run", "all", "--config", str(config), *(a for s in sets for a in ("--set", s))])


def test_control_dropout_without_nocontrol_embeds_is_refused_before_any_encoder_loads(tiny_plus_model, tmp_path,
                                                                                      monkeypatch):
    loaded, real_load = [], models.loading.load_component
    monkeypatch.setattr(models.loading, "load_component", lambda *a, **k: loaded.append(a[1]) or real_load(*a, **k))
    r = _run_all(tmp_path, tiny_plus_model, "train.control_dropout=0.5")
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(lines) == 1 and "Traceback" not in r.output, r.output
    # names the setting, why, and both ways on
    assert lines[0].startswith("error: train.control_dropout 0.5 needs the text table's nocontrol_embeds"), lines[0]
    assert "set encode_text.no_control_embeds: true" in lines[0] and "train.control_dropout: 0" in lines[0], lines[0]
    assert loaded == [], loaded  # no encoder (nor anything else) loaded
    assert not (tmp_path / "store").exists() and not (tmp_path / "run").exists()  # nothing resized, nothing trained
