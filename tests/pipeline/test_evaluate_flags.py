"""`pipeline run evaluate`'s --run and --lora: each names what is evaluated, and a flag that would be ignored is
refused. Before, `--run RUN` without --all-checkpoints was ignored and paths.run's LoRA evaluated (the report of
another run than the one named, with nothing saying so), and --lora with --all-checkpoints was ignored too."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"paths": {"store": str(tmp_path / "store"), "model": str(tmp_path / "model"),
                                             "run": str(tmp_path / "configured-run"),
                                             "report": str(tmp_path / "report")}}))
    return cfg


def test_run_names_the_lora_evaluated(tmp_path, monkeypatch):
    import stages.evaluate.stage as stage

    seen = []

    def fake_run(cfg, store, model, lora_dir, report, skip_if_done=False):
        seen.append(lora_dir)
        raise SystemExit(0)

    monkeypatch.setattr(stage, "run", fake_run)
    # the command's own path checks (before the stage's import) are not what is tested here: no model is built
    monkeypatch.setattr("models.loading.resolve_model", Path)
    monkeypatch.setattr("models.lora_files.lora_weight_file", Path)
    cfg = _config(tmp_path)
    Store(tmp_path / "store")  # empty: a folder without store.json is refused before the stage
    CliRunner().invoke(app, ["run", "evaluate", "--config", str(cfg), "--run", str(tmp_path / "named-run")])
    CliRunner().invoke(app, ["run", "evaluate", "--config", str(cfg)])
    assert seen == [str(tmp_path / "named-run" / "lora"), str(tmp_path / "configured-run" / "lora")]


def test_flags_that_would_be_ignored_are_usage_errors(tmp_path):
    cfg = _config(tmp_path)
    for extra in (["--all-checkpoints", "--lora", str(tmp_path / "l")],
                  ["--run", str(tmp_path / "r"), "--lora", str(tmp_path / "l")]):
        result = CliRunner().invoke(app, ["run", "evaluate", "--config", str(cfg), *extra])
        assert result.exit_code == 2, result.output
        assert "--lora" in result.output and "Traceback" not in result.output
