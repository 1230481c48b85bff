"""encode-text / encode-vae of Edit, Edit-2511 (the Plus pipeline over a `zero_cond_t` transformer) and
Qwen-Image-2.1 models against their unmodified diffusers pipelines, one sample per call, on the inputs the other
reference tests leave out: unicode captions, a caption past the 1024 tokens of the pipelines' `max_sequence_length`
(which they never apply), 0..3 controls of mixed sizes, batch 8 (exact and padded text, same-size VAE batches)
against each sample alone."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from pipeline.config import load_config
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from store import Store

CAPTIONS = [
    "把天空换成日落 🌅, make it brighter",
    "Ersetze den Hund durch eine Katze – café naïve e\u0301 \u200b zero-width",
    "",
    " ".join(f"step {i}: move the red square a little to the left and add a small blue circle" for i in range(90)),
    "🎩🐱",
]
PADDED_RTOL = 1e-6  # as test_encode_text.py: measured 8.9e-8 .. 2.4e-7 on the tiny Plus model


@pytest.fixture(scope="module")
def model_2511(tmp_path_factory):
    from models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "tiny-2511", variant="edit-2511", seed=0))


def _samples(fx):
    one, two, three = [(160, 160)], [(128, 192), (160, 160)], [(192, 128), (160, 160), (128, 192)]
    vae = {1: [(64, 64)], 2: [(48, 80), (64, 64)], 3: [(80, 48), (64, 64), (48, 80)]}
    spec = [(0, one), (1, two), (2, three), (3, one), (4, []), (0, []), (1, one), (3, two)]
    return [fx.Sample(CAPTIONS[c], (64, 64) if i % 2 else (48, 80), vae.get(len(vl), []), vl, mask=i % 3 == 0)
            for i, (c, vl) in enumerate(spec)]


def _pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def _text_refs(pipe, images) -> dict:
    refs = {}
    for key in images.keys():
        s = images.get(key)
        vl = [_pil(s["files"][f"control_{i}_vl.png"]) for i in range(s["meta"]["num_controls"])] or None
        refs[key] = {}
        for kind, caption in (("prompt_embeds", s["meta"]["caption"]), ("empty_embeds", "")):
            embeds, mask = pipe.encode_prompt(caption, image=vl, device="cpu")
            refs[key][kind] = embeds[0] if mask is None else embeds[0][mask[0].bool()]
    return refs


def test_2511_text_and_latents_equal_the_stock_pipeline_per_sample(model_2511, tmp_path, images_fixture):
    from diffusers import QwenImageEditPlusPipeline

    store = tmp_path / "s"
    images_fixture.write(store, _samples(images_fixture))
    pipe = QwenImageEditPlusPipeline.from_pretrained(model_2511, torch_dtype=torch.float32)
    images = Store(store).reader("images")
    refs = _text_refs(pipe, images)
    longest = max(len(pipe.tokenizer(c)["input_ids"]) for c in CAPTIONS)
    assert longest > 1024, longest  # past max_sequence_length: stored whole, as the stock encode_prompt returns it

    cfg = {"encode_text.dtype": "float32", "encode_vae.dtype": "float32", "encode_text.batch_size": 8}
    exact = encode_text.run(load_config(None, cfg), store, model_2511)
    assert (exact.encoded, exact.quarantined) == (len(refs), 0)
    text = Store(store).reader("text")
    for key, ref in refs.items():  # exact batching: bit for bit the float32 reference rounded to bf16
        got = text.get(key)
        for name, r in ref.items():
            assert torch.equal(got["tensors"][name], r.to(torch.bfloat16)), (key, name)
        assert got["meta"]["length"] == ref["prompt_embeds"].shape[0]
    padded = encode_text.run(load_config(None, {**cfg, "encode_text.batching": "padded"}), store, model_2511)
    assert padded.forward_items / padded.forwards > 2  # batches really mixed
    text = Store(store).reader("text")
    for key, ref in refs.items():
        for name, r in ref.items():
            err = (text.get(key)["tensors"][name].float() - r).abs()
            assert (err <= 2**-8 * r.abs() + PADDED_RTOL * r.abs().max()).all(), (key, name)

    v = encode_vae.run(load_config(None, cfg), store, model_2511, batch_size=8)
    assert v.encoded == len(refs) and v.forward_items / v.forwards > 1
    vae = Store(store).reader("vae")
    with torch.no_grad():
        for key in refs:
            s = images.get(key)
            names = ["target"] + [f"control_{i}" for i in range(s["meta"]["num_controls"])]
            got = vae.get(key)["tensors"]
            assert sorted(got) == sorted(names + (["mask_weight"] if "mask.png" in s["files"] else []))
            for n in names:
                im = _pil(s["files"][f"{n}.png"])
                want = pipe._encode_vae_image(pipe.image_processor.preprocess(im, im.height, im.width).unsqueeze(2),
                                              generator=None)[0]
                assert ((got[n].float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all(), (key, n)


def test_edit_text_equals_the_stock_pipeline_on_unicode_and_long_captions(tiny_edit_model, tmp_path, images_fixture):
    """Edit (one control, the VL model sees the VAE view): exact batches of 8, bit for bit per sample."""
    from diffusers import QwenImageEditPipeline

    fx = images_fixture
    sizes = [(160, 160), (128, 192), (160, 160), (192, 128), (160, 160), (160, 160)]
    samples = [fx.Sample(CAPTIONS[i % len(CAPTIONS)], (64, 64), [s], [s]) for i, s in enumerate(sizes)]
    store = tmp_path / "s"
    fx.write(store, samples)
    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model, torch_dtype=torch.float32)
    encode_text.run(load_config(None, {"encode_text.dtype": "float32"}), store, tiny_edit_model, batch_size=8)
    images, text = Store(store).reader("images"), Store(store).reader("text")
    assert sorted(text.keys()) == sorted(images.keys())
    for key in images.keys():
        s = images.get(key)
        control = _pil(s["files"]["control_0.png"])
        got = text.get(key)["tensors"]
        for name, caption in (("prompt_embeds", s["meta"]["caption"]), ("empty_embeds", "")):
            embeds, mask = pipe.encode_prompt(caption, image=control, device="cpu")
            want = embeds[0] if mask is None else embeds[0][mask[0].bool()]  # (None: every token valid)
            assert torch.equal(got[name], want.to(torch.bfloat16)), (key, name)


def test_21_text_and_latents_equal_the_stock_pipeline_on_unicode_and_long_captions(tiny_21_model, tmp_path,
                                                                                   images_fixture):
    """Qwen-Image-2.1 (text: one sample per call): prompt and empty prompt with 0..3 references of mixed sizes;
    latents in batches of 8."""
    from diffusers import QwenImage21Pipeline

    fx = images_fixture
    refs = [[], [(64, 96)], [(64, 64), (96, 32), (32, 64)], [(96, 64), (64, 64)], [(32, 32)]]
    samples = [fx.Sample(c, (64, 96), r, r) for c, r in zip(CAPTIONS, refs)]
    store = tmp_path / "s"
    fx.write(store, samples)
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model)
    summary = encode_text.run(load_config(None, {"encode_text.dtype": "float32"}), store, tiny_21_model)
    assert (summary.encoded, summary.quarantined) == (len(samples), 0)
    images, text = Store(store).reader("images"), Store(store).reader("text")
    for key in images.keys():
        s = images.get(key)
        pictures = [Image.open(io.BytesIO(s["files"][f"control_{i}.png"])).convert("RGBA")
                    for i in range(s["meta"]["num_controls"])] or None
        got = text.get(key)["tensors"]
        for e, m, caption in (("prompt_embeds", "slot_mask", s["meta"]["caption"]),
                              ("empty_embeds", "empty_slot_mask", "")):
            want, _, slots = pipe.encode_prompt(prompt=caption, image=pictures, device="cpu")
            assert torch.equal(got[e], want[0].to(torch.bfloat16)), (key, e)
            assert torch.equal(got[m], slots[0].bool())

    # encode-vae, batch 8 (same-size pictures share a forward): within a bf16 step of the stock latent alone
    v = encode_vae.run(load_config(None, {"encode_vae.dtype": "float32"}), store, tiny_21_model, batch_size=8)
    assert v.encoded == len(samples) and v.forward_items / v.forwards > 1
    vae = Store(store).reader("vae")
    with torch.no_grad():
        for key in images.keys():
            s, got = images.get(key), vae.get(key)["tensors"]
            for n in ["target"] + [f"control_{i}" for i in range(s["meta"]["num_controls"])]:
                im = Image.open(io.BytesIO(s["files"][f"{n}.png"])).convert("RGBA")
                pixels = pipe.image_processor.preprocess(im, width=im.width, height=im.height).unsqueeze(2)
                want = pipe._encode_vae_image(pixels, None)[0]
                assert ((got[n].float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all(), (key, n)
