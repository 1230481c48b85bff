"""One denoising step: Qwen-Image-2.1's scheduler takes it (no terminal stretch: σ 1 -> 0 in one Euler step, a
finite image); the Edit models' scheduler stretches its σs to `shift_terminal`, which at one step divides 0 by 0
(every latent NaN, a black image), so a 1 is refused there, before any loading, in one line naming the setting and
the model (predict.steps, evaluate.num_inference_steps, train.sample_steps). Before, the config refused 1 for every
model."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import load_config
from schemas.errors import UserError


def _ref(tmp_path, mode: str = "RGB"):
    path = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (32, 32, len(mode)), dtype=np.uint8).squeeze(),
                    mode).save(path)
    return path


def test_qwen21_samples_in_one_step(tiny_21_model, tmp_path):
    out = tmp_path / "out.png"
    r = CliRunner().invoke(app, ["predict", "--model", tiny_21_model, "--image", str(_ref(tmp_path, "RGBA")),
                                 "--prompt", "p", "--steps", "1", "--height", "32", "--width", "32", "--out", str(out)])
    assert r.exit_code == 0, r.output
    pixels = np.asarray(Image.open(out), dtype=np.float64)
    assert pixels.std() > 0  # NaN latents decode to one flat colour (0 after the cast)


def test_the_edit_schedulers_one_step_is_nan(tiny_edit_model):
    """What the refusal guards against, on the Edit models' own scheduler config."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    from models.loading import load_component

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(load_component(tiny_edit_model, "scheduler").config)
    scheduler.set_timesteps(sigmas=[1.0], mu=0.5)
    assert torch.isnan(scheduler.timesteps).all()


def test_predict_refuses_one_step_on_an_edit_model_before_loading(tiny_edit_model, tiny_plus_model, tmp_path):
    from models.loading import LOAD_LOG

    for model in (tiny_edit_model, tiny_plus_model):
        out = tmp_path / "out.png"
        LOAD_LOG.clear()
        r = CliRunner().invoke(app, ["predict", "--model", model, "--image", str(_ref(tmp_path)), "--prompt", "p",
                                     "--steps", "1", "--height", "32", "--width", "32", "--out", str(out)])
        lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert r.exit_code == 2 and len(lines) == 1, r.output  # a usage mistake, judged from the scheduler config
        assert "predict.steps" in lines[0] and model in lines[0] and "2 or more" in lines[0], lines[0]
        assert not out.exists() and LOAD_LOG == []


def test_evaluate_and_train_refuse_one_step_on_an_edit_model(tiny_edit_model, tmp_path):
    from stages.evaluate.settings import for_model
    from stages.train.recipe import run

    cfg = load_config(None, {"evaluate.num_inference_steps": 1, "evaluate.num_samples": 1}).evaluate
    with pytest.raises(UserError, match=f"evaluate.num_inference_steps = 1: .*{tiny_edit_model}"):
        for_model(cfg, tiny_edit_model)
    for_model(cfg.model_copy(update={"num_samples": 0}), tiny_edit_model)  # no images: the steps are unused

    out = tmp_path / "run"
    cfg = load_config(None, {"train.device": "cpu", "train.sample_every": 1, "train.sample_steps": 1})
    with pytest.raises(UserError, match=f"train.sample_steps = 1: .*{tiny_edit_model}"):
        run(cfg, tmp_path / "store", tiny_edit_model, out)  # before the store is opened or OUT made
    assert not out.exists()


def test_evaluate_and_train_take_one_step_on_qwen21(tiny_21_model):
    from models.loading import check_sampling_steps
    from stages.evaluate.settings import for_model

    cfg = load_config(None, {"evaluate.num_inference_steps": 1, "evaluate.num_samples": 1}).evaluate
    assert for_model(cfg, tiny_21_model).num_inference_steps == 1
    check_sampling_steps(1, "train.sample_steps", tiny_21_model)


def test_run_all_refuses_one_step_on_an_edit_model_before_its_first_stage(tiny_edit_model, tmp_path):
    """`pipeline run all` asks before resize-bucket. Before, train refused it when it started, after resize-bucket
    and both encoders (hours at a million samples), and evaluate's steps only after the whole training."""
    import yaml

    store = tmp_path / "store"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"source": str(tmp_path / "src"), "store": str(store),
                                                "model": tiny_edit_model, "run": str(tmp_path / "run"),
                                                "report": str(tmp_path / "report")}}))
    for sets, setting in ((["train.sample_every=1", "train.sample_steps=1"], "train.sample_steps"),
                          (["evaluate.num_inference_steps=1"], "evaluate.num_inference_steps")):
        r = CliRunner().invoke(app, ["run", "all", "--config", str(config),
                                     *(a for s in sets for a in ("--set", s))])
        lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert r.exit_code == 1 and len(lines) == 1, r.output
        assert lines[0].startswith(f"error: {setting} = 1: ") and tiny_edit_model in lines[0], lines[0]
        assert not store.exists() and not (tmp_path / "run").exists()
