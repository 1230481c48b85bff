"""evaluate's extra prompts (stages/evaluate/qwen21.py, sample_images.py): each prompt encoded once, the text
encoder gone before the first image, the images those of the stock pipeline call predict makes."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import torch
from PIL import Image

from features.pictures import rgb_over_white
from pipeline.config import load_config


def test_21_extra_prompts_encode_once_and_generate_without_the_text_encoder(tiny_21_model, tmp_path, monkeypatch):
    """Before: every column (base, LoRA; base, best, last) re-ran the text encoder through the stock call, and
    the encoder stayed on the device through all of them. Now: one stock `encode_prompt` per prompt (and per
    negative: true CFG here), no text encoder alive while the transformer runs, and the images bit-for-bit
    those of today's path (`edit_21` on the stock pipeline, text encoder loaded). Two extras share a prompt with
    other references: the encodings are per extra, not per prompt text."""
    from diffusers import QwenImage21Pipeline

    import models.loading
    from models.loading import load_component
    from models.qwen21_predict import edit_21
    from stages.evaluate.qwen21 import extra_inputs_21

    rng = np.random.default_rng(5)
    refs = []
    for i, (h, w, mode) in enumerate([(64, 96, "RGBA"), (96, 64, "RGB"), (64, 64, "RGBA")]):
        refs.append(tmp_path / f"ref{i}.png")
        Image.fromarray(rng.integers(0, 255, (h, w, len(mode)), dtype=np.uint8), mode).save(refs[-1])
    extras = [{"prompt": "make it red", "images": [str(refs[0])], "height": 64, "width": 96},
              {"prompt": "make it red", "images": [str(refs[1]), str(refs[2])], "height": 96, "width": 64}]
    cfg = load_config(None, {"evaluate.dtype": "float32", "evaluate.num_inference_steps": 2,
                             "evaluate.true_cfg_scale": 2.0, "evaluate.negative_prompt": "blurry",
                             "evaluate.extra_prompts": extras}).evaluate

    stock = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    expected = [rgb_over_white(edit_21(stock, [Image.open(p) for p in e["images"]], e["prompt"], cfg.negative_prompt,
                                       cfg.num_inference_steps, cfg.true_cfg_scale, cfg.seed, e["height"], e["width"]))
                for e in extras]  # 2.1 decodes RGBA: the report's RGB is over white, as its targets are
    del stock

    encodes = []
    stock_encode = QwenImage21Pipeline._get_qwen_prompt_embeds
    monkeypatch.setattr(QwenImage21Pipeline, "_get_qwen_prompt_embeds",
                        lambda self, prompt, *a, **k: (encodes.append(prompt), stock_encode(self, prompt, *a, **k))[1])
    encoder = _text_encoders_loaded(monkeypatch, models.loading)
    transformer = load_component(tiny_21_model, "transformer", dtype=torch.float32)
    vae = load_component(tiny_21_model, "vae", dtype=torch.float32)
    encoder_alive = []
    transformer.register_forward_pre_hook(lambda module, args: encoder_alive.append(encoder[0]() is not None))

    jobs = list(extra_inputs_21(tiny_21_model, transformer, vae, cfg))
    gc.collect()
    for _ in range(3):  # base, best, last
        for (*_, cond, _h, _w, _s), want in zip(jobs, expected):
            np.testing.assert_array_equal(np.asarray(cond()), np.asarray(want))

    assert len(encoder) == 1 and encoder_alive and not any(encoder_alive)
    assert sorted(map(tuple, encodes)) == sorted([("make it red",), ("blurry",)] * 2)  # once per extra and prompt


def test_edit_extra_prompts_generate_without_the_text_encoder(tiny_edit_model, tmp_path, monkeypatch):
    """Single-LoRA evaluate on an Edit model: before, `extra_rows` (now `extra_jobs` + `paired_rows`) generated each extra while the generator's
    pipeline (text encoder included) was still alive; now every extra is encoded first and the text encoder is
    unreferenced whenever the transformer runs. The images are those of the prepared conditioning, base and LoRA."""
    from peft import LoraConfig

    import models.edit
    from models.generate import generate
    from models.loading import load_component
    from stages.evaluate.checkpoint_report import extra_jobs
    from stages.evaluate.lora_attach import lora_enabled
    from stages.evaluate.sample_images import extra_prompt_inputs, paired_rows

    ref = tmp_path / "ref.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(ref)
    cfg = load_config(None, {"evaluate.dtype": "float32", "evaluate.num_inference_steps": 2,
                             "evaluate.extra_prompts": [{"prompt": "make it red", "images": [str(ref)],
                                                         "height": 48, "width": 64}]}).evaluate
    # the controls' view at 256² rather than the stock ~1024² (as tests/stages/test_predict.py): the text and VAE
    # encoding of each extra prompt's control took seconds of CPU; nothing asserted here depends on its size
    monkeypatch.setattr(models.edit, "VAE_AREA", 256 * 256)
    encoder = _text_encoders_loaded(monkeypatch, models.edit)
    transformer = load_component(tiny_edit_model, "transformer", dtype=torch.float32)
    torch.manual_seed(0)
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"], init_lora_weights="gaussian"))
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    vae = load_component(tiny_edit_model, "vae", dtype=torch.float32)

    _, _, _, _, cond, h, w, sched = next(extra_prompt_inputs(tiny_edit_model, transformer, vae, cfg))
    want = []
    for on in (False, True):
        with lora_enabled(transformer, on):
            want.append(generate(transformer, vae, sched, cond, h, w, cfg.num_inference_steps, cfg.true_cfg_scale,
                                 cfg.seed))
    gc.collect()
    encoder.clear()
    encoder_alive = []
    transformer.register_forward_pre_hook(lambda module, args: encoder_alive.append(encoder[0]() is not None))
    (row,) = paired_rows(extra_jobs(cfg, tiny_edit_model, transformer, vae, False), transformer, vae, cfg, False)
    assert encoder_alive and not any(encoder_alive)
    assert not np.array_equal(np.asarray(want[0]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(row.base), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(row.lora), np.asarray(want[1]))


def _text_encoders_loaded(monkeypatch, module) -> list:
    """A weak reference to each text encoder `module.load_component` loads from now on (alive or freed)."""
    encoder = []
    load = module.load_component

    def loading(model, component, *a, **k):
        out = load(model, component, *a, **k)
        if component == "text_encoder":
            encoder.append(weakref.ref(out))
        return out

    monkeypatch.setattr(module, "load_component", loading)
    return encoder


def test_evaluate_refuses_a_too_elongated_extra_prompt_image_at_its_start(tiny_edit_model, tiny_plus_model,
                                                                          tiny_21_model, tmp_path):
    """evaluate's start check (`for_model`, which `pipeline run all` runs before training) decoded each extra
    prompt's image but not its shape: one the stock resize rounds to 0 px or the VL processor's 200:1 refuses was
    PIL's / transformers' ValueError when the pictures were made, after training and the held-out passes. Now one
    line naming the image; one pixel inside the limit passes (predict edits it: test_predict.py, same sizes)."""
    import pytest

    from schemas.errors import UserError
    from stages.evaluate.settings import for_model

    square = tmp_path / "square.png"
    Image.new("RGB", (32, 32), "gray").save(square)
    for model, inside, outside, size in ((tiny_edit_model, (2000, 13), (2000, 12), {}),
                                         (tiny_plus_model, (2000, 8), (2000, 7), {}),
                                         (tiny_21_model, (2559, 10), (2560, 10), {"height": 256, "width": 256})):
        for shape, ok in ((inside, True), (outside, False)):
            image = tmp_path / f"{shape[0]}x{shape[1]}.png"
            Image.new("RGB", shape, "gray").save(image)
            cfg = load_config(None, {"evaluate.extra_prompts": [{"prompt": "fine", "images": [str(square)], **size},
                                                                {"prompt": "q", "images": [str(image)], **size}]})
            cfg = cfg.evaluate
            if ok:
                for_model(cfg, model)
                continue
            with pytest.raises(UserError, match=rf"evaluate.extra_prompts\[1\] image {image}: .* too elongated"):
                for_model(cfg, model)


def test_evaluate_refuses_an_extra_prompt_size_the_pipeline_would_round_down(tiny_edit_model, tiny_21_model,
                                                                             tmp_path):
    """height / width of an extra prompt were rounded down as predict's --height / --width were (height 100
    written as 96 px, the report not saying so). Now evaluate's start check (`for_model`, which `pipeline run all`
    runs before training) refuses them with predict's rule (`models.control_shapes.check_output_size`), naming
    the setting; a multiple of the model's own passes."""
    import pytest

    from schemas.errors import UserError
    from stages.evaluate.settings import for_model

    image = tmp_path / "c.png"
    Image.new("RGB", (64, 64), "gray").save(image)
    for model, multiple in ((tiny_edit_model, 16), (tiny_21_model, 32)):
        def cfg(width):
            return load_config(None, {"evaluate.extra_prompts": [
                {"prompt": "fine", "images": [str(image)], "height": 64, "width": 64},
                {"prompt": "q", "images": [str(image)], "height": 64, "width": width}]}).evaluate

        for_model(cfg(3 * multiple), model)
        down = 100 // multiple * multiple
        with pytest.raises(UserError, match=rf"^evaluate\.extra_prompts\[1\]\.width = 100: .* multiples of {multiple} "
                                            rf"px, and its pipeline would write {down} px instead; set "
                                            rf"evaluate\.extra_prompts\[1\]\.width to {down} or {down + multiple}$"):
            for_model(cfg(100), model)
