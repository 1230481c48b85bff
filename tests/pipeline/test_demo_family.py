"""`pipeline demo --config C` builds the tiny model of the family C's paths.model names."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from pipeline.cli import app

CONFIG_21 = Path(__file__).parents[2] / "configs" / "qwen-image-2.1.yaml"
# the 2.1 config's stages, shortened: the run end to end is what is tested, not what it learns
SHORT = {"train.max_steps": 2, "train.checkpoint_every": 2, "evaluate.timesteps": "[0.5]",
         "evaluate.noise_seeds": "[0]", "evaluate.num_samples": 1, "evaluate.num_inference_steps": 2,
         "resize.max_controls": 3}


def test_the_demo_with_the_21_config_builds_a_21_model_and_runs_end_to_end(tmp_path, monkeypatch):
    """It built an Edit-Plus model whatever the config, then refused the 2.1 config's settings with "set
    resize.vl_views: true" (exit 1): the wrong way for a user who wanted 2.1."""
    from models.loading import model_variant
    from pipeline.commands import demo

    monkeypatch.setattr(demo, "DEMO_SAMPLES", 10)
    monkeypatch.chdir(tmp_path)
    work = tmp_path / "demo-workdir-qwen-image-2.1"  # no --workdir: the 2.1 demo's own, beside demo-workdir
    sets = [x for k, v in SHORT.items() for x in ("--set", f"{k}={v}")]
    res = CliRunner().invoke(app, ["demo", "--config", str(CONFIG_21), *sets])
    assert res.exit_code == 0, res.output
    assert f"wrote a tiny random-init Qwen-Image-2.1 model to {work / 'tiny-model'}" in res.output
    assert model_variant(str(work / "tiny-model")) == "qwen-image-2.1"
    assert demo._named_variant(str(work / "tiny-model")) == "qwen-image-2.1"  # a model folder: its model_index
    assert "== demo summary" in res.output and "val loss     base" in res.output
    assert (work / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert json.loads((work / "report" / "metrics.json").read_text())["loss"]["overall"]["n"] > 0
    # the default config into this workdir: refused before any work, not an Edit-Plus run on the 2.1 model
    config = (work / "config.yaml").read_text()
    res = CliRunner().invoke(app, ["demo", "--workdir", str(work)])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert (f"--workdir {work} holds an earlier demo's tiny qwen-image-2.1 model ({work / 'tiny-model'}), and this "
            f"config is for the edit-plus family: pass a new or empty --workdir") in res.output
    assert (work / "config.yaml").read_text() == config and not (work / "config.previous.yaml").exists()


def test_a_config_for_a_family_the_demo_cannot_build_is_one_line(tmp_path):
    work = tmp_path / "w"
    res = CliRunner().invoke(app, ["demo", "--workdir", str(work), "--set", "paths.model=Qwen/Qwen-Image-Layered"])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert ("paths.model Qwen/Qwen-Image-Layered is of the Qwen-Image-Layered family, and the demo builds tiny "
            "edit-plus (Qwen-Image-Edit-Plus) and qwen-image-2.1 (Qwen-Image-2.1) models only") in res.output
    assert not work.exists()


def test_a_name_that_is_no_folder_here_says_the_family():
    from pipeline.commands.demo import _named_variant, default_workdir

    assert _named_variant("demo-workdir/tiny-model") == "edit-plus"  # configs/demo.yaml: says no family
    assert (str(default_workdir("edit-plus")), str(default_workdir("qwen-image-2.1"))) == (
        "demo-workdir", "demo-workdir-qwen-image-2.1")  # one per family: both demos run without --workdir
    assert _named_variant("demo-workdir/tiny-qwen-image-2.1") == "qwen-image-2.1"
    assert _named_variant("Qwen/Qwen-Image-2.1") == "qwen-image-2.1"
    assert _named_variant("Qwen/Qwen-Image-Edit-2509") == "edit-plus"
    assert _named_variant("Qwen/Qwen-Image-Edit-2511") == "edit-2511"
    assert _named_variant("Qwen/Qwen-Image-Edit") == "edit"
    assert _named_variant("Qwen/Qwen-Image") == "Qwen-Image"


def test_a_model_folder_whose_index_does_not_parse_is_named_by_its_name(tmp_path):
    """A model_index.json that is no JSON object gave a traceback (its json.loads outside the handler's reach, or
    `.get` on a list): the folder's name says the family instead."""
    from pipeline.commands.demo import _named_variant

    for i, text in enumerate(["{not json", "[1, 2]", "\"a string\""]):
        folder = tmp_path / f"tiny-qwen-image-2.1-{i}"
        folder.mkdir()
        (folder / "model_index.json").write_text(text)
        assert _named_variant(str(folder)) == "qwen-image-2.1", text
