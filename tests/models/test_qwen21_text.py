"""2.1 prompt encoding equals the stock `QwenImage21Pipeline.encode_prompt` (full pipeline from the tiny folder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from models.loading import load_component
from models.qwen21_text import encode_prompt, grid_mismatch, prompt_encoder, slot_runs


def _img(h, w, mode, seed):
    ch = 4 if mode == "RGBA" else 3
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, ch) * 255).astype("uint8"), mode)


@pytest.mark.parametrize("refs", [[], [(64, 96, "RGBA")], [(64, 64, "RGB"), (96, 32, "RGBA"), (32, 64, "RGB")]])
@pytest.mark.parametrize("caption", ["make the square red", ""])
def test_matches_stock_pipeline_encode_prompt(tiny_21_model, refs, caption):
    from diffusers import QwenImage21Pipeline

    stock = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    images = [_img(h, w, m, i) for i, (h, w, m) in enumerate(refs)]
    want, want_mask, want_slots = stock.encode_prompt(prompt=caption, image=images or None, device="cpu")
    assert want_mask is None  # one prompt: no padding
    ours = prompt_encoder(load_component(tiny_21_model, "text_encoder"), load_component(tiny_21_model, "processor"))
    embeds, slots = encode_prompt(ours, caption, images)
    assert torch.equal(embeds, want[0]) and torch.equal(slots, want_slots[0].bool())
    assert slot_runs(slots) == [(h // 32) * (w // 32) for h, w, _ in refs]
    assert grid_mismatch(slots, [(h, w) for h, w, _ in refs]) is None
    if refs:
        assert "VLM gave" in grid_mismatch(slots, [(h + 32, w) for h, w, _ in refs])


def test_rgba_reference_is_composited_over_white_for_the_vlm(tiny_21_model):
    """Transparent pixels read as white by the VLM (as the stock pipeline does): a fully transparent image of any
    colour encodes like a white one."""
    ours = prompt_encoder(load_component(tiny_21_model, "text_encoder"), load_component(tiny_21_model, "processor"))
    clear = Image.new("RGBA", (64, 64), (10, 200, 30, 0))
    white = Image.new("RGB", (64, 64), (255, 255, 255))
    red = Image.new("RGB", (64, 64), (255, 0, 0))
    a, _ = encode_prompt(ours, "x", [clear])
    assert torch.equal(a, encode_prompt(ours, "x", [white])[0])
    assert not torch.equal(a, encode_prompt(ours, "x", [red])[0])


def test_generation_from_stored_features_equals_the_stock_pipeline(tiny_21_model):
    """`models.qwen21_generate.generate_21` from the prompt encoding and the normalised reference latents (what
    the store holds) gives the stock `QwenImage21Pipeline` image (no KV cache), bit for bit."""
    from diffusers import QwenImage21Pipeline

    from models.qwen21_generate import generate_21

    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    ref = _img(64, 96, "RGBA", 0).convert("RGBA")
    want = pipe(image=[ref], prompt="make it red", output_resolution=78, height=64, width=96, num_inference_steps=3,
                generator=torch.Generator().manual_seed(5), use_kv_cache=False, output_type="np").images[0]
    embeds, slots = encode_prompt(prompt_encoder(pipe.text_encoder, pipe.processor), "make it red", [ref])
    pixels = pipe.image_processor.preprocess(ref, width=96, height=64).unsqueeze(2)
    with torch.no_grad():
        latent = pipe._encode_vae_image(pixels, None)[0]
    got = generate_21(pipe.transformer, pipe.vae, pipe.scheduler, embeds, slots, [latent], 64, 96, 3, 5,
                      output_type="np")
    np.testing.assert_array_equal(got, want)


def test_guided_generation_from_stored_features_equals_the_stock_pipeline(tiny_21_model):
    """True CFG as evaluate's val images and train's sample grid run it (`evaluate.true_cfg_scale` > 1): the
    negative is the stored empty prompt with the sample's references, which is the stock call with
    `negative_prompt=""`; the image equals the stock `QwenImage21Pipeline`'s (no KV cache), bit for bit."""
    from diffusers import QwenImage21Pipeline

    from models.qwen21_generate import generate_21

    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    # sizes the pipeline keeps at output_resolution 78 (calculate_dimensions(78², 3:2 or 2:3) = the same sides)
    refs = [_img(64, 96, "RGBA", 0).convert("RGBA"), _img(96, 64, "RGB", 1).convert("RGBA")]
    want = pipe(image=refs, prompt="make it red", negative_prompt="", true_cfg_scale=3.0, output_resolution=78,
                height=64, width=96, num_inference_steps=3, generator=torch.Generator().manual_seed(5),
                use_kv_cache=False, output_type="np").images[0]
    encoder = prompt_encoder(pipe.text_encoder, pipe.processor)
    embeds, slots = encode_prompt(encoder, "make it red", refs)
    negative = encode_prompt(encoder, "", refs)
    latents = []
    for r in refs:
        pixels = pipe.image_processor.preprocess(r, width=r.width, height=r.height).unsqueeze(2)
        with torch.no_grad():
            latents.append(pipe._encode_vae_image(pixels, None)[0])
    got = generate_21(pipe.transformer, pipe.vae, pipe.scheduler, embeds, slots, latents, 64, 96, 3, 5,
                      true_cfg_scale=3.0, negative=negative, output_type="np")
    unguided = generate_21(pipe.transformer, pipe.vae, pipe.scheduler, embeds, slots, latents, 64, 96, 3, 5,
                           output_type="np")
    assert np.abs(got - unguided).max() > 1e-3  # guidance changes the image
    np.testing.assert_array_equal(got, want)
