"""The `images` table's stored pictures as PIL images: the one decoder the encoders and evaluate share (a stage
may not import another)."""

from __future__ import annotations

import io

from PIL import Image


def open_png(data: bytes, mode: str = "RGB") -> Image.Image:
    """A stored PNG as a PIL image in `mode` (the images table holds sanitised 8-bit PNGs), decoded once."""
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        return im.convert(mode) if im.mode != mode else im.copy()
