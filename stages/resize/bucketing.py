"""Bucket math (pure): which (height, width) an image of a given size is resized to.

The rule is diffusers' `calculate_dimensions` from `pipeline_qwenimage_edit_plus.py`, which Qwen-Image-Edit(-Plus)
applies at inference: width = sqrt(area * ratio), height = width / ratio, each rounded (Python `round`, i.e. half
to even) to a multiple of 32. Here the multiple is configurable, the aspect ratio is first clamped to
`max_aspect` (a 10:1 strip would otherwise round a side to 0), and no side is below `min_side` (rounded up to the
multiple). With `multiple=32` and an aspect inside the clamp this returns exactly what diffusers returns, so
training sees controls at the sizes inference uses.

Views of one sample:
- target: area `target_area`;
- each control, VAE view (what the VAE encodes): area `control_vae_area` (diffusers' VAE_IMAGE_SIZE = 1024²);
- each control, VL view (what Qwen2.5-VL sees): area `control_vl_area` (diffusers' CONDITION_IMAGE_SIZE = 384²).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# VAE spatial factor 8 x transformer patch 2: every side must be a multiple of this to pack into tokens


@dataclass(frozen=True)
class BucketRule:
    area: int
    multiple: int = 32
    max_aspect: float = 4.0
    min_side: int = 32


def clamp_ratio(width: int, height: int, max_aspect: float) -> float:
    """width / height, clamped to [1/max_aspect, max_aspect]."""
    ratio = width / height
    return min(max(ratio, 1.0 / max_aspect), max_aspect)


def bucket_size(width: int, height: int, rule: BucketRule) -> tuple[int, int]:
    """(height, width) of the bucket for an image of `width` x `height` pixels."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    ratio = clamp_ratio(width, height, rule.max_aspect)
    w = math.sqrt(rule.area * ratio)
    h = w / ratio
    m = rule.multiple
    floor = -(-max(rule.min_side, m) // m) * m  # min_side rounded up to the multiple
    return max(floor, round(h / m) * m), max(floor, round(w / m) * m)


def largest_bucket(rule: BucketRule, max_pixels: int) -> tuple[int, int] | None:
    """(height, width) of the largest bucket `rule` gives a picture of at most `max_pixels` pixels (a square one,
    or the widest or tallest one, 1 pixel across, where `min_side` lifts the short side), or None when a side is
    too large to compute (an area times a huge ratio overflowing a float)."""
    try:
        sizes = [bucket_size(w, h, rule) for w, h in ((1, 1), (max_pixels, 1), (1, max_pixels))]
    except OverflowError:
        return None
    return max(sizes, key=lambda hw: hw[0] * hw[1])


def crop_box_for_aspect(width: int, height: int, max_aspect: float) -> tuple[int, int, int, int]:
    """Centred crop (left, top, right, bottom) bringing an image inside the aspect clamp; whole image if inside."""
    ratio = width / height
    if ratio > max_aspect:
        new_w = max(1, round(height * max_aspect))
        left = (width - new_w) // 2
        return left, 0, left + new_w, height
    if ratio < 1.0 / max_aspect:
        new_h = max(1, round(width * max_aspect))
        top = (height - new_h) // 2
        return 0, top, width, top + new_h
    return 0, 0, width, height


def same_aspect(a: tuple[int, int], b: tuple[int, int], tolerance: float) -> bool:
    """Whether sizes `a` and `b` (width, height) have one aspect ratio, up to `tolerance` (relative) plus what
    rounding each side of `a` to whole pixels explains (a mask saved at half its target's size, an odd side
    halved): a 512x384 mask of a 1025x769 target is its aspect, a 10x300 one of a 300x10 target is not."""
    (aw, ah), (bw, bh) = a, b
    slack = math.log1p(tolerance + 1 / aw + 1 / ah)
    return abs(math.log((aw * bh) / (ah * bw))) <= slack
