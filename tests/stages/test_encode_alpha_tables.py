"""An `images` table made with `resize.keep_alpha` (RGBA pictures, for Qwen-Image-2.1) encoded for an Edit-Plus
model: its pictures are composited over white, as resize-bucket composites every other table's, for the VAE and
the VL view alike. Before: Pillow's RGBA -> RGB dropped the alpha, so transparent areas reached the encoders as
whatever colour they held (black here) instead of white."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from pipeline.config import load_config
from stages.encode import vae as encode_vae
from stages.encode.text import control_images
from stages.resize.stage import run as resize
from store import Store

SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 64 * 64,
         "resize.multiple": 16, "resize.min_side": 16, "resize.keep_alpha": True, "encode_vae.dtype": "float32"}


def _half_transparent(colour) -> bytes:
    arr = np.zeros((64, 64, 4), np.uint8)  # left half: alpha 0 over black, as many editors save it
    arr[:, 32:] = (*colour, 255)
    b = io.BytesIO()
    Image.fromarray(arr, "RGBA").save(b, format="PNG")
    return b.getvalue()


def _over_white(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data)).convert("RGBA")
    flat = Image.new("RGBA", im.size, (255, 255, 255, 255))
    flat.alpha_composite(im)
    return flat.convert("RGB")


def test_a_keep_alpha_table_reaches_edit_plus_encoders_composited_over_white(tiny_plus_model, tmp_path):
    from diffusers import QwenImageEditPlusPipeline

    src = tmp_path / "src"
    for d in ("target", "control"):
        (src / d).mkdir(parents=True)
    (src / "target" / "a.png").write_bytes(_half_transparent((200, 30, 30)))
    (src / "target" / "a.txt").write_text("make it blue")
    (src / "control" / "a.png").write_bytes(_half_transparent((30, 30, 200)))
    cfg = load_config(None, SMALL)
    resize(cfg, src, tmp_path / "store")
    images = Store(tmp_path / "store").reader("images")
    [key] = images.keys()
    sample = images.get(key)
    assert Image.open(io.BytesIO(sample["files"]["target.png"])).mode == "RGBA"  # the 2.1 layout

    [vl] = control_images(sample["files"], "edit-plus", 1)  # what encode-text hands the VL processor
    assert vl.getpixel((0, 0)) == (255, 255, 255) and vl.getpixel((63, 0)) == (30, 30, 200)

    encode_vae.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
    pipe = QwenImageEditPlusPipeline.from_pretrained(tiny_plus_model, torch_dtype=torch.float32)
    got = Store(tmp_path / "store").reader("vae").get(key)["tensors"]
    for name in ("target", "control_0"):
        im = _over_white(sample["files"][f"{name}.png"])
        with torch.no_grad():
            want = pipe._encode_vae_image(pipe.image_processor.preprocess(im, im.height, im.width).unsqueeze(2), None)[0]
        assert torch.equal(got[name], want.to(torch.bfloat16)), name


def test_21_encoders_say_how_many_cut_outs_resize_flattened_unless_flattening_was_set(tiny_21_model, tmp_path,
                                                                                       capsys, monkeypatch):
    """resize.keep_alpha unset (false) composited a 2.1 store's transparent pictures over white; its encoders,
    whose VAE reads RGBA, said nothing (resize's `converted:` line alone hinted at it). Now each says how many
    samples and which setting, once a run; keep_alpha: false set on purpose, or a table kept RGBA: no line."""
    from stages.encode import text as encode_text

    src = tmp_path / "src"
    for d in ("target", "control"):
        (src / d).mkdir(parents=True)
    for name, colour in (("a", (200, 30, 30)), ("b", None)):
        picture = _half_transparent(colour) if colour else _opaque()
        (src / "target" / f"{name}.png").write_bytes(picture)
        (src / "control" / f"{name}.png").write_bytes(_opaque())
        (src / "target" / f"{name}.txt").write_text("make it blue")
    small = {**{k: v for k, v in SMALL.items() if k != "resize.keep_alpha"}, "resize.multiple": 32,
             "resize.min_side": 32, "resize.val_fraction": 0.0, "encode_text.dtype": "float32"}
    unset = load_config(None, small)
    resize(unset, src, tmp_path / "flat")
    capsys.readouterr()
    said = "1 of 2 sample(s) of images v1 have pictures whose transparency resize-bucket composited over white " \
           "(rendered with resize.keep_alpha false)"
    for stage, run in (("encode-vae", encode_vae.run), ("encode-text", encode_text.run)):
        run(unset, tmp_path / "flat", tiny_21_model)
        out = capsys.readouterr().out
        lines = [ln for ln in out.splitlines() if "composited over white" in ln]
        assert len(lines) == 1 and lines[0].startswith(f"{stage}: {said}; {tiny_21_model}"), out
        assert "resize.keep_alpha: true" in lines[0], lines[0]
    # the count is the images version's: its `conversions` column is read once (the first run), not on every run
    # (the whole column, seconds at 1M rows, also for a run with nothing to encode): an up-to-date rerun says the
    # same line from the note beside the version
    from store.reader import TableReader

    real, read = TableReader.column, []
    monkeypatch.setattr(TableReader, "column", lambda self, name: read.append((self.table, name)) or real(self, name))
    assert encode_vae.run(unset, tmp_path / "flat", tiny_21_model).up_to_date
    assert f"encode-vae: {said}" in capsys.readouterr().out
    assert ("images", "conversions") not in read, read
    monkeypatch.setattr(TableReader, "column", real)

    on_purpose = load_config(None, {**small, "resize.keep_alpha": False})
    encode_vae.run(on_purpose, tmp_path / "flat", tiny_21_model)
    kept = load_config(None, {**small, "resize.keep_alpha": True})
    resize(kept, src, tmp_path / "rgba")
    encode_vae.run(unset, tmp_path / "rgba", tiny_21_model)
    assert "composited over white" not in capsys.readouterr().out


def _opaque() -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (64, 64), (30, 30, 200)).save(b, format="PNG")
    return b.getvalue()
