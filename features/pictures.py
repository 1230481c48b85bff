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
        return rgb_over_white(im) if mode == "RGB" else im.convert(mode)


def rgb_over_white(im: Image.Image) -> Image.Image:
    """`im` as RGB, a transparent one (alpha band, or a palette / grey transparency key) composited over white as
    resize-bucket composites the training pictures (Pillow's convert("RGB") drops the alpha: transparent pixels
    show the colour they store, often black)."""
    if im.mode == "RGB":
        return im
    if "A" not in im.getbands() and "transparency" not in im.info:
        return im.convert("RGB")
    return flattened(im, (255, 255, 255))


def flattened(im: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """A transparent picture composited over an opaque `background`, as RGB (the one alpha composite: the
    encoders, evaluate and resize-bucket's decoder)."""
    flat = Image.new("RGBA", im.size, (*background, 255))
    flat.alpha_composite(im.convert("RGBA"))
    return flat.convert("RGB")
