"""From the user's files to the stored features, against the stock pipelines' own `__call__` on the same files:
resize-bucket then encode-text / encode-vae (float32, batch 1) store exactly what the unmodified
`QwenImageEditPlusPipeline` / `QwenImage21Pipeline` compute from the pictures as diffusers' readers give them
(`load_image`: EXIF turned; 2.1: the file as opened, alpha kept), with their own sizing of each control (VL and
VAE views, 2.1's one reference size) and their own empty negative. The other tests start from stored views;
this one covers the resize step between (bucket rule, Lanczos from the source, mode conversions, order).

The Plus pipeline's condition areas are module constants (384², 1024²): set smaller here, with the same areas in
`resize`, so the tiny VAE encodes small pictures; the pipeline class and its code are unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from pipeline.config import load_config
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from stages.resize.stage import run as resize_bucket
from store import Store

VL_AREA, VAE_AREA = 96 * 96, 160 * 160


class _Stop(Exception):
    pass


def _smooth(rng, h: int, w: int, channels: int = 3) -> np.ndarray:
    base = rng.integers(0, 255, (h // 16 + 1, w // 16 + 1, channels), dtype=np.uint8)
    up = np.kron(base, np.ones((16, 16, 1), dtype=np.uint8))[:h, :w]
    return np.clip(up.astype(np.int16) + rng.integers(-30, 30, (h, w, channels)), 0, 255).astype(np.uint8)


def _save(rng, h: int, w: int, kind: str, path: Path) -> None:
    if kind in ("RGBA", "LA"):
        a = _smooth(rng, h, w, 4)
        a[: h // 3, :, 3] = 0
        a[h // 3 : h // 2, :, 3] = 128
        im = Image.fromarray(a, "RGBA")
        (im if kind == "RGBA" else im.convert("LA")).save(path)
    elif kind == "P-transparent":
        Image.fromarray(_smooth(rng, h, w)).convert("P").save(path, transparency=0)
    elif kind == "JPEG-EXIF6":  # shown turned a quarter: the reader must apply it
        exif = Image.Exif()
        exif[0x0112] = 6
        Image.fromarray(_smooth(rng, h, w)).save(path, "JPEG", exif=exif, quality=90)
    else:  # RGB, L, P
        Image.fromarray(_smooth(rng, h, w)).convert(kind).save(path, "PNG")


def _source(root: Path, samples: dict[str, tuple[str, list[tuple[int, int, str]]]]) -> Path:
    rng = np.random.default_rng(0)
    for stem, (caption, controls) in samples.items():
        (root / "target").mkdir(parents=True, exist_ok=True)
        Image.fromarray(_smooth(rng, 128, 96)).save(root / "target" / f"{stem}.png")
        (root / "target" / f"{stem}.txt").write_text(caption)
        for i, (h, w, kind) in enumerate(controls):
            folder = root / ("control" if i == 0 else f"control_{i}")
            folder.mkdir(exist_ok=True)
            _save(rng, h, w, kind, folder / f"{stem}.png")
    return root


def _controls(src: Path, stem: str, n: int, read) -> list[Image.Image]:
    return [read(src / ("control" if i == 0 else f"control_{i}") / f"{stem}.png") for i in range(n)]


def _recording(pipe) -> dict[str, list]:
    """The stock call's own encodings, recorded as it makes them; the call stops after the VAE encodes."""
    rec: dict[str, list] = {"prompts": [], "latents": []}
    encode_prompt, encode_image, prepare_latents = pipe.encode_prompt, pipe._encode_vae_image, pipe.prepare_latents

    def prompts(*a, **k):
        rec["prompts"].append(out := encode_prompt(*a, **k))
        return out

    def latents(image, generator):
        rec["latents"].append(out := encode_image(image, generator))
        return out

    def stop(*a, **k):
        prepare_latents(*a, **k)
        raise _Stop

    pipe.encode_prompt, pipe._encode_vae_image, pipe.prepare_latents = prompts, latents, stop
    return rec


def _valid(embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return embeds[0] if mask is None else embeds[0][mask[0].bool()]


def _stem_of(samples, caption: str) -> str:
    return next(s for s, (c, _) in samples.items() if c.strip() == caption)


def test_edit_plus_features_from_source_files_equal_the_stock_call(tiny_plus_model, tmp_path, monkeypatch):
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
    from diffusers.utils import load_image

    samples = {"a": ("make it red", [(70, 100, "RGB")]),
               "b": (" add a hat <|im_start|> 🎩 ", [(90, 50, "L"), (40, 140, "P")]),
               "c": ("x", [(30, 30, "JPEG-EXIF6"), (61, 41, "RGB"), (100, 103, "L")])}
    src = _source(tmp_path / "src", samples)
    cfg = load_config(None, {"resize.control_vl_area": VL_AREA, "resize.control_vae_area": VAE_AREA,
                             "resize.target_area": 96 * 128, "resize.max_controls": 3, "resize.val_fraction": 0.0,
                             "encode_text.dtype": "float32", "encode_vae.dtype": "float32",
                             "encode_text.batch_size": 1, "encode_vae.batch_size": 1})
    store = tmp_path / "store"
    resize_bucket(cfg, src, store)
    assert encode_text.run(cfg, store, tiny_plus_model).encoded == 3
    assert encode_vae.run(cfg, store, tiny_plus_model).encoded == 3

    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", VL_AREA)
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", VAE_AREA)
    pipe = QwenImageEditPlusPipeline.from_pretrained(tiny_plus_model, torch_dtype=torch.float32)
    rec = _recording(pipe)
    text, vae, images = (Store(store).reader(t) for t in ("text", "vae", "images"))
    for key in text.keys():
        caption = images.meta(key)["caption"]
        stem = _stem_of(samples, caption)
        controls = _controls(src, stem, len(samples[stem][1]), lambda p: load_image(str(p)))
        rec["prompts"].clear(), rec["latents"].clear()
        with pytest.raises(_Stop):
            pipe(image=controls, prompt=caption, negative_prompt="", true_cfg_scale=2.0, num_inference_steps=1,
                 output_type="latent")
        got = text.get(key)["tensors"]
        (prompt, prompt_mask), (empty, empty_mask) = rec["prompts"]
        assert torch.equal(got["prompt_embeds"], _valid(prompt, prompt_mask).to(torch.bfloat16)), stem
        assert torch.equal(got["empty_embeds"], _valid(empty, empty_mask).to(torch.bfloat16)), stem
        latents = vae.get(key)["tensors"]
        assert len(rec["latents"]) == len(controls)  # one call per control, in order
        for i, want in enumerate(rec["latents"]):
            assert torch.equal(latents[f"control_{i}"], want[0].to(torch.bfloat16)), (stem, i)


def test_21_features_from_source_files_equal_the_stock_call(tiny_21_model, tmp_path):
    from diffusers import QwenImage21Pipeline

    resolution = 128
    samples = {"a": ("make it red", [(80, 110, "RGBA")]),
               "b": ("two refs", [(60, 60, "LA"), (100, 45, "P-transparent")]),
               "c": ("opaque ones", [(75, 120, "RGB"), (90, 90, "L"), (60, 93, "JPEG-EXIF6")])}
    src = _source(tmp_path / "src", samples)
    cfg = load_config("configs/qwen-image-2.1.yaml", {
        "resize.control_vae_area": resolution**2, "resize.target_area": resolution**2, "resize.val_fraction": 0.0,
        "encode_text.device": "cpu", "encode_vae.device": "cpu"})
    store = tmp_path / "store"
    resize_bucket(cfg, src, store)
    assert encode_text.run(cfg, store, tiny_21_model).encoded == 3
    assert encode_vae.run(cfg, store, tiny_21_model).encoded == 3

    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_model, torch_dtype=torch.float32)
    rec = _recording(pipe)
    text, vae, images = (Store(store).reader(t) for t in ("text", "vae", "images"))
    for key in text.keys():
        caption = images.meta(key)["caption"]
        stem = _stem_of(samples, caption)
        refs = _controls(src, stem, len(samples[stem][1]), lambda p: ImageOps.exif_transpose(Image.open(p)))
        rec["prompts"].clear(), rec["latents"].clear()
        with pytest.raises(_Stop):
            pipe(image=refs, prompt=caption, negative_prompt="", true_cfg_scale=2.0, output_resolution=resolution,
                 num_inference_steps=1, output_type="latent")
        got = text.get(key)["tensors"]
        for (embeds, mask, slots), name, slot_name in zip(rec["prompts"], ("prompt_embeds", "empty_embeds"),
                                                          ("slot_mask", "empty_slot_mask")):
            assert torch.equal(got[name], _valid(embeds, mask).to(torch.bfloat16)), (stem, name)
            assert torch.equal(got[slot_name], _valid(slots, mask).bool()), (stem, slot_name)
        want = [one for call in rec["latents"] for one in call]  # per call: a batch of references
        latents = vae.get(key)["tensors"]
        assert len(want) == len(refs)
        for i in range(len(refs)):
            assert torch.equal(latents[f"control_{i}"], want[i].to(torch.bfloat16)), (stem, i)
