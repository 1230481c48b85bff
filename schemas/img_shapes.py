"""img_shapes math: per sample `[(frames, h, w), ...]` in transformer patch units, target first then each control."""

from __future__ import annotations

from typing import Any, Sequence

# VAE downsamples by 8 and the transformer packs 2x2 latent patches: one patch = 16x16 pixels.
PIXELS_PER_PATCH = 16

ImgShape = tuple[int, int, int]


def img_shapes_from_pixels(h_px: int, w_px: int) -> ImgShape:
    """(1, H // 16, W // 16): one frame, patch rows, patch cols of an image of H x W pixels."""
    return (1, int(h_px) // PIXELS_PER_PATCH, int(w_px) // PIXELS_PER_PATCH)


def img_shapes_from_v1(row: dict[str, Any]) -> list[ImgShape]:
    """Derive v2 img_shapes from a schema-v1 manifest row (target height/width + optional single control)."""
    shapes = [img_shapes_from_pixels(row["height"], row["width"])]
    ch, cw = row.get("control_height"), row.get("control_width")
    if ch and cw:  # null or 0 = the sample had no control
        shapes.append(img_shapes_from_pixels(ch, cw))
    return shapes


def normalize_img_shapes(value: Any) -> list[ImgShape]:
    """Validate and convert to a list of 3-int tuples; raises ValueError naming what is wrong."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or len(value) == 0:
        raise ValueError(f"img_shapes must be a non-empty list of [frames, h, w], got {value!r}")
    out: list[ImgShape] = []
    for s in value:
        if len(s) != 3 or any(int(v) != v or int(v) <= 0 for v in s):
            raise ValueError(f"img_shapes entry must be 3 positive ints [frames, h, w], got {s!r}")
        out.append((int(s[0]), int(s[1]), int(s[2])))
    return out
