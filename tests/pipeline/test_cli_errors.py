"""Mistakes a user makes get one actionable line and a non-zero exit, and never touch existing data."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import ConfigError, load_config


def _run(args: list[str]):
    return CliRunner().invoke(app, args)


def test_demo_data_and_tiny_model_refuse_a_non_empty_folder(tmp_path):
    out = tmp_path / "data"
    assert _run(["make-demo-data", str(out), "--n", "3"]).exit_code == 0
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    r = _run(["make-demo-data", str(out), "--n", "2", "--seed", "5"])
    assert r.exit_code == 1 and "not empty" in r.output and "Traceback" not in r.output
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing mixed in
    r = _run(["make-tiny-model", str(out)])
    assert r.exit_code == 1 and "not empty" in r.output


def test_predict_rejects_a_non_lora_file_a_missing_gpu_and_a_tiny_size(tiny_edit_model, tmp_path):
    from PIL import Image

    img = tmp_path / "in.png"
    Image.new("RGB", (64, 48), (200, 10, 10)).save(img)
    not_lora = tmp_path / "c.yaml"
    not_lora.write_text("train: {}\n")
    base = ["predict", "--model", tiny_edit_model, "--image", str(img), "--prompt", "x", "--steps", "2"]
    r = _run(base + ["--lora", str(not_lora), "--out", str(tmp_path / "a.png")])
    assert r.exit_code == 1 and "no LoRA weights" in r.output
    r = _run(base + ["--height", "8", "--width", "8", "--out", str(tmp_path / "b.png")])
    assert r.exit_code == 1 and "at least 16" in r.output
    r = _run(base + ["--transformer-device", "cuda:7", "--out", str(tmp_path / "c.png")])
    assert r.exit_code == 1 and "predict.devices.transformer" in r.output and "CUDA device" in r.output
    assert not any((tmp_path / n).exists() for n in ("a.png", "b.png", "c.png"))


def test_one_inference_step_is_a_valid_config_and_none_is_not():
    """1 step samples Qwen-Image-2.1 (its scheduler has no terminal stretch); the Edit models refuse it where the
    model is known (tests/stages/test_one_step_sampling.py). Before, the config refused 1 for every model."""
    for key in ("predict.steps", "evaluate.num_inference_steps", "train.sample_steps"):
        section, name = key.split(".")
        assert getattr(getattr(load_config(None, {key: 1}), section), name) == 1
        with pytest.raises(ConfigError, match=name):
            load_config(None, {key: 0})


@pytest.mark.parametrize("key,value", [
    ("evaluate.timesteps", [1.5]), ("evaluate.timesteps", [0.0]), ("train.validate_timesteps", [-0.1]),
    ("train.learning_rate", float("inf")), ("train.learning_rate", float("nan")), ("train.lora.alpha", 0),
    ("train.adam_betas", [0.9, 1.0]), ("train.adam_eps", 0), ("train.max_grad_norm", float("inf")),
    ("evaluate.lora_scale", float("nan")), ("resize.max_aspect", float("inf")), ("train.sigma.logit_std", 0),
])
def test_out_of_range_and_non_finite_settings_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=key.split(".")[-1]):
        load_config(None, {key: value})


def test_non_finite_yaml_through_the_cli_is_one_line(tmp_path):
    r = _run(["config", "show", "--set", "train.learning_rate=.inf"])
    assert r.exit_code == 2 and "learning_rate" in r.output and "Traceback" not in r.output
