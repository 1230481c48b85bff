"""The `images` table's stored pictures as PIL images: the one decoder the encoders and evaluate share (a stage
may not import another)."""

from __future__ import annotations

import io

from PIL import Image


def open_png(data: bytes, mode: str = "RGB") -> Image.Image:
    """A stored PNG as a PIL image in `mode` (the images table holds sanitised 8-bit PNGs), decoded once.

    An RGBA picture (a table made with `resize.keep_alpha`, for Qwen-Image-2.1) asked for as RGB is composited
    over white, as resize-bucket composites every other table's images: Pillow's own RGBA -> RGB drops the alpha
    and shows whatever colour the transparent pixels hold (often black)."""
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        if im.mode == mode:
            return im.copy()
        if im.mode == "RGBA" and mode == "RGB":
            flat = Image.new("RGBA", im.size, (255, 255, 255, 255))
            flat.alpha_composite(im)
            return flat.convert("RGB")
        return im.convert(mode)
