"""resize.keep_alpha (Qwen-Image-2.1): an image with transparency is stored as RGBA instead of composited over white.

Qwen-Image-2.1's VAE reads four channels (RGBA in, RGBA out); its pipeline composites over white only the copy the
VLM sees (encode-text does the same from the stored RGBA). Every other image decodes as `decode_image` does.
"""

from __future__ import annotations

from stages.resize.imaging import _ALPHA, Decoded, _open_oriented, as_rgb


def decode_keeping_alpha(data: bytes, max_pixels: int) -> Decoded:
    """Bytes -> RGBA when the image has an alpha channel or a transparent palette entry, else what `decode_image`
    gives, from the one decode (a second `decode_image` decoded every opaque image twice)."""
    im, notes, orientation = _open_oriented(data, max_pixels)
    if im.mode in _ALPHA or (im.mode == "P" and "transparency" in im.info):
        return Decoded(im.convert("RGBA"), notes + [f"{im.mode} kept with its alpha (RGBA)"], orientation)
    return as_rgb(im, notes, orientation)
