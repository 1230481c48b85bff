"""A 2.1 model folder may fix its sampling sigmas (`QwenImage21Pipeline(sample_sigmas=...)`, saved in
model_index.json; the stock `__call__` then uses them and ignores `num_inference_steps`). predict, evaluate (val
images and extra prompts) and train's sample grid build their pipeline / loop by hand: each must use them as
`QwenImage21Pipeline.from_pretrained` does, or its images are not the model's."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from features.pictures import rgb_over_white

SIGMAS = [1.0, 0.7, 0.35]  # three steps; every call below asks for 2


@pytest.fixture(scope="module")
def model_with_sigmas(tiny_21_model, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("m") / "tiny-21-sigmas"
    shutil.copytree(tiny_21_model, out)
    index = json.loads((out / "model_index.json").read_text())
    index["sample_sigmas"] = SIGMAS
    (out / "model_index.json").write_text(json.dumps(index))
    return str(out)


def _ref() -> Image.Image:
    return Image.fromarray(np.random.default_rng(3).integers(0, 255, (64, 96, 4), dtype=np.uint8), "RGBA")


def _stock(model, **kw):
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline.from_pretrained(model)
    assert list(pipe.config.sample_sigmas) == SIGMAS
    return pipe(image=[_ref()], prompt="make it red", num_inference_steps=2, height=64, width=96,
                output_resolution=78, generator=torch.Generator().manual_seed(0), output_type="pil", **kw).images[0]


def test_predict_uses_the_models_sample_sigmas(model_with_sigmas):
    from models.qwen21_predict import edit_21, load_pipeline_21

    pipe = load_pipeline_21(model_with_sigmas, torch.float32, {})
    got = edit_21(pipe, [_ref()], "make it red", None, 2, 1.0, 0, 64, 96)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_stock(model_with_sigmas)))


def test_evaluate_extra_prompts_use_the_models_sample_sigmas(model_with_sigmas, tmp_path):
    from models.loading import load_component
    from pipeline.config import load_config
    from stages.evaluate.qwen21 import extra_inputs_21

    ref = tmp_path / "ref.png"
    _ref().save(ref)
    cfg = load_config(None, {"evaluate.dtype": "float32", "evaluate.num_inference_steps": 2, "evaluate.seed": 0,
                             "evaluate.true_cfg_scale": 1.0,
                             "evaluate.extra_prompts": [{"prompt": "make it red", "images": [str(ref)],
                                                         "height": 64, "width": 96}]}).evaluate
    transformer = load_component(model_with_sigmas, "transformer")
    vae = load_component(model_with_sigmas, "vae")
    [(_, _, _, _, cond, *_)] = extra_inputs_21(model_with_sigmas, transformer, vae, cfg)
    np.testing.assert_array_equal(np.asarray(cond()), np.asarray(rgb_over_white(_stock(model_with_sigmas))))


def _stored_sample(pipe):
    """What the store holds for the stock call above: prompt encoding, empty prompt, normalised reference latent."""
    from models.qwen21_text import encode_prompt, prompt_encoder

    ref = pipe.image_processor.resize(_ref(), width=96, height=64)
    encoder = prompt_encoder(pipe.text_encoder, pipe.processor)
    embeds, slots = encode_prompt(encoder, "make it red", [ref])
    empty, empty_slots = encode_prompt(encoder, "", [ref])
    with torch.no_grad():
        latent = pipe._encode_vae_image(pipe.image_processor.preprocess(ref, width=96, height=64).unsqueeze(2),
                                        None)[0]
    return SimpleNamespace(prompt_embeds=embeds, slot_mask=slots, empty_embeds=empty, empty_slot_mask=empty_slots,
                           controls=[latent], img_shapes=[[1, 4, 6], [1, 4, 6]], key="k" * 32)


def test_evaluate_val_images_and_the_train_sample_grid_use_the_models_sample_sigmas(model_with_sigmas):
    from diffusers import QwenImage21Pipeline

    from models.qwen21_generate import scheduler_config_21
    from stages.evaluate.qwen21 import image_21
    from stages.train.validate import Validator

    pipe = QwenImage21Pipeline.from_pretrained(model_with_sigmas)
    s = _stored_sample(pipe)
    cfg = SimpleNamespace(num_inference_steps=2, seed=0, true_cfg_scale=1.0)
    got = image_21(pipe.transformer, pipe.vae, scheduler_config_21(model_with_sigmas), s, cfg)
    want = _stock(model_with_sigmas, use_kv_cache=False)  # the loop from stored features has no KV cache
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rgb_over_white(want)))

    validator = Validator.__new__(Validator)  # the sample grid's 2.1 image, without a store around it
    validator.model, validator.cfg = model_with_sigmas, SimpleNamespace(sample_steps=2, seed=0)
    validator._vae, validator._scheduler = pipe.vae, dict(pipe.scheduler.config)
    got = validator._sample_21(pipe.transformer, s, 4, 6)
    want = _stock(model_with_sigmas, use_kv_cache=False)  # the grid samples 2.1 without guidance, as the pipeline
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rgb_over_white(want)))


def test_a_model_folder_with_sample_sigmas_is_complete(model_with_sigmas, tmp_path):
    """model_index.json's `sample_sigmas` is a setting, not a component folder: the folder loads. Before: refused
    as "incomplete: component folder(s) ['sample_sigmas'] ... missing". A missing component is still named."""
    from models.loading import ModelNotFoundError, load_component, resolve_model

    assert load_component(model_with_sigmas, "scheduler") is not None
    broken = tmp_path / "broken"
    shutil.copytree(model_with_sigmas, broken, ignore=shutil.ignore_patterns("vae"))
    with pytest.raises(ModelNotFoundError, match=r"\['vae'\]"):
        resolve_model(str(broken))


def test_the_report_and_predict_name_the_steps_the_images_were_made_with(model_with_sigmas, tiny_21_model, tmp_path):
    """The images above take the model's 3 sigmas whatever `num_inference_steps` says; the report's settings line
    said "2 Euler steps" (a number that was not what ran) and predict took `--steps 2` silently. Now the report
    names the model's sigmas and predict says its --steps is unused; a model without them keeps its steps."""
    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.config import load_config
    from stages.evaluate.generation_summary import generation_summary

    cfg = load_config(None, {"evaluate.num_inference_steps": 2}).evaluate
    settings = generation_summary([], cfg, model_with_sigmas)["settings"]
    assert settings.startswith("3 Euler steps at the model's own sample_sigmas [1.0, 0.7, 0.35]"), settings
    assert "num_inference_steps = 2 unused" in settings
    assert generation_summary([], cfg, tiny_21_model)["settings"].startswith("2 Euler steps (dynamic shift)")

    ref = tmp_path / "ref.png"
    _ref().save(ref)
    result = CliRunner().invoke(app, ["predict", "--model", model_with_sigmas, "--image", str(ref), "--prompt", "p",
                                      "--steps", "2", "--height", "64", "--width", "96", "--out", str(tmp_path / "o.png")])
    assert result.exit_code == 0, result.output
    assert "--steps / predict.steps 2 is unused" in result.output
