"""evaluate's extra prompts on Qwen-Image-2.1 (stages/evaluate/qwen21.py): each prompt encoded once, the text
encoder gone before the first image, the images those of the stock pipeline call predict makes."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import torch
from PIL import Image

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
    expected = [edit_21(stock, [Image.open(p) for p in e["images"]], e["prompt"], cfg.negative_prompt,
                        cfg.num_inference_steps, cfg.true_cfg_scale, cfg.seed, e["height"], e["width"]).convert("RGB")
                for e in extras]
    del stock

    encodes = []
    stock_encode = QwenImage21Pipeline._get_qwen_prompt_embeds
    monkeypatch.setattr(QwenImage21Pipeline, "_get_qwen_prompt_embeds",
                        lambda self, prompt, *a, **k: (encodes.append(prompt), stock_encode(self, prompt, *a, **k))[1])
    encoder = []
    load = models.loading.load_component

    def loading(model, component, *a, **k):
        out = load(model, component, *a, **k)
        if component == "text_encoder":
            encoder.append(weakref.ref(out))
        return out

    monkeypatch.setattr(models.loading, "load_component", loading)
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
