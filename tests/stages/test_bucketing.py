"""Bucket math: agrees with diffusers' calculate_dimensions (Edit-Plus), sides are multiples, aspect is clamped."""

from __future__ import annotations

import itertools

import pytest

from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions as edit_dims
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    VAE_IMAGE_SIZE,
    calculate_dimensions,
)

from schemas.config import ResizeConfig
from schemas.img_shapes import img_shapes_from_pixels as img_shape
from stages.resize.bucketing import BucketRule, bucket_size, crop_box_for_aspect

SIZES = [(w, h) for w, h in itertools.product([33, 48, 100, 257, 320, 640, 1000, 1024, 1920, 3001], repeat=2) if max(w, h) / min(w, h) <= 4]


def test_agrees_with_diffusers_for_the_default_views():
    cfg = ResizeConfig()
    for area in (cfg.control_vl_area, cfg.control_vae_area, cfg.target_area, 512 * 512, 64 * 64):
        rule = BucketRule(area=area, multiple=32, max_aspect=4.0, min_side=32)
        for w, h in SIZES:
            dw, dh = calculate_dimensions(area, w / h)
            if dw >= 32 and dh >= 32:  # below that diffusers returns 0-sized sides, which we floor
                assert bucket_size(w, h, rule) == (dh, dw), (area, w, h)
    # the defaults are the Edit-Plus constants; the Edit pipeline uses the same rule at 1024²
    assert (cfg.control_vl_area, cfg.control_vae_area) == (CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE)
    for w, h in SIZES:
        assert edit_dims(VAE_IMAGE_SIZE, w / h)[:2] == calculate_dimensions(VAE_IMAGE_SIZE, w / h)


def test_sides_are_multiples_and_area_is_near_target():
    for multiple, area in [(16, 96 * 96), (32, 1024 * 1024), (64, 768 * 768)]:
        rule = BucketRule(area=area, multiple=multiple, max_aspect=4.0, min_side=multiple)
        for w, h in SIZES:
            bh, bw = bucket_size(w, h, rule)
            assert bh % multiple == 0 and bw % multiple == 0 and bh >= multiple and bw >= multiple
            ratio = min(max(w / h, 0.25), 4.0)
            # each side is within half a multiple of the exact-area, exact-aspect size
            exact_w = (area * ratio) ** 0.5
            assert abs(bw - exact_w) <= multiple / 2 + 1e-9 or bw == multiple
            assert abs(bh - exact_w / ratio) <= multiple / 2 + 1e-9 or bh == multiple


def test_aspect_is_preserved_as_closely_as_the_grid_allows():
    rule = BucketRule(area=1024 * 1024, multiple=32)
    for w, h in SIZES:
        bh, bw = bucket_size(w, h, rule)
        # no neighbouring grid size with about the same area has a closer aspect ratio by more than one step
        err = abs(bw / bh - w / h) / (w / h)
        assert err < 0.07, (w, h, bh, bw)
    assert bucket_size(1024, 1024, rule) == (1024, 1024)
    assert bucket_size(1920, 1080, rule) == (768, 1376)  # what diffusers picks for 16:9 at 1024²


def test_extreme_aspect_is_clamped_and_cropped():
    rule = BucketRule(area=256 * 256, multiple=32, max_aspect=4.0, min_side=32)
    assert bucket_size(10000, 100, rule) == bucket_size(400, 100, rule) == (128, 512)
    assert bucket_size(100, 10000, rule) == (512, 128)
    assert crop_box_for_aspect(1000, 100, 4.0) == (300, 0, 700, 100)
    assert crop_box_for_aspect(100, 1000, 4.0) == (0, 300, 100, 700)
    assert crop_box_for_aspect(300, 200, 4.0) == (0, 0, 300, 200)
    # tiny areas never give a side below min_side
    assert min(bucket_size(50, 50, BucketRule(area=100, multiple=16, min_side=40))) == 48


def test_img_shape_is_in_patch_units():
    assert img_shape(1024, 768) == (1, 64, 48)
    assert img_shape(64, 96) == (1, 4, 6)


def test_every_shipped_config_and_the_largest_legal_bucket_pass_the_bucket_size_check():
    """The check refusing absurd buckets (stages/resize/stage.py `check_config`) lets every shipped config and a
    bucket of exactly 64 Mpx through; one pixel-row more is refused unless max_image_pixels reads larger pictures."""
    from pathlib import Path

    from pipeline.config import load_config
    from schemas import UserError
    from stages.resize.stage import check_config

    for path in sorted((Path(__file__).parents[2] / "configs").glob("*.yaml")):
        check_config(load_config(path).resize)
    check_config(ResizeConfig(area=8192 * 8192))
    with pytest.raises(UserError, match="gives buckets of up to 8224x8224 = 67634176 px, over the 67108864 px"):
        check_config(ResizeConfig(area=8224 * 8224))
    check_config(ResizeConfig(area=8224 * 8224, max_image_pixels=8224 * 8224))
