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
