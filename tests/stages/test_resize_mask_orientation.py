"""A mask made from a target's stored pixels (a phone JPEG with EXIF orientation 6, its mask written by a tool that
read it with PIL, which ignores EXIF) turns with its target instead of being stretched across the other axis.
Before: it was resized from 96x64 to 64x96, so its edit region lay across the wrong part of the picture."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from pipeline.config import load_config
from stages.resize.stage import run
from store import Store

SMALL = {"resize.target_area": 64 * 96, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.val_fraction": 0.0}


def _target_jpeg(fmt: str = "JPEG", **kw) -> bytes:
    """Stored 96x64 (w x h): left third red (the edited part), the rest blue; EXIF orientation 6 (shown 64x96)."""
    arr = np.zeros((64, 96, 3), np.uint8)
    arr[:, :32] = (255, 0, 0)
    arr[:, 32:] = (0, 0, 255)
    ex = Image.Exif()
    ex[0x0112] = 6
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format=fmt, exif=ex.tobytes(), **(kw or {"quality": 98}))
    return b.getvalue()


def _mask_png(width: int, height: int, edited) -> bytes:
    arr = np.zeros((height, width), np.uint8)
    arr[edited] = 255
    b = io.BytesIO()
    Image.fromarray(arr, "L").save(b, format="PNG")
    return b.getvalue()


def _stored(store, stem: str, suffix: str = ".jpg"):
    r = Store(store).reader("images")
    [key] = [k for k in r.keys() if r.meta(k)["source"].endswith(f"{stem}{suffix}")]
    files, meta = r.files(key), r.meta(key)
    target = np.asarray(Image.open(io.BytesIO(files["target.png"])).convert("RGB")).astype(int)
    mask = np.asarray(Image.open(io.BytesIO(files["mask.png"])))
    return target, mask, meta


def test_a_mask_of_the_stored_pixels_turns_with_its_exif_rotated_target(tmp_path):
    src = tmp_path / "src"
    for d in ("target", "mask"):
        (src / d).mkdir(parents=True)
    for stem, caption, mask in (
        ("stored", "paint the red part green", _mask_png(96, 64, np.s_[:, :32])),  # the stored layout
        ("shown", "paint the red part yellow", _mask_png(64, 96, np.s_[:32, :])),  # already the shown layout
    ):
        (src / "target" / f"{stem}.jpg").write_bytes(_target_jpeg())
        (src / "target" / f"{stem}.txt").write_text(caption)
        (src / "mask" / f"{stem}.png").write_bytes(mask)
    run(load_config(None, SMALL), src, tmp_path / "store")

    for stem in ("stored", "shown"):
        target, mask, meta = _stored(tmp_path / "store", stem)
        assert target.shape[:2] == mask.shape == (96, 64)  # portrait, as shown
        red = (target[..., 0] > 128) & (target[..., 2] < 128)
        edited = mask > 128
        assert red[:28].all() and not red[36:].any()  # the stored left third is the shown top third
        assert (edited == red).mean() > 0.97, stem  # only the resampled edge row may differ
        turned = "mask turned as its target (EXIF orientation 6)" in meta["conversions"]
        assert turned == (stem == "stored")


def test_a_tiff_png_or_webp_target_turns_its_mask_as_a_jpeg_does(tmp_path):
    """The same rule for every format: Pillow turns a TIFF by its tag while loading and drops the tag, so the TIFF
    was noted no orientation and its mask of the stored pixels, not turned, was quarantined as bad-mask (another
    aspect). A PNG's or WebP's eXIf orientation is read as a JPEG's."""
    src = tmp_path / "src"
    for d in ("target", "mask"):
        (src / d).mkdir(parents=True)
    targets = {".tif": _target_jpeg("TIFF", compression="tiff_lzw"), ".png": _target_jpeg("PNG", optimize=False),
               ".webp": _target_jpeg("WEBP", lossless=True)}
    for suffix, data in targets.items():
        stem = f"stored_{suffix[1:]}"
        (src / "target" / f"{stem}{suffix}").write_bytes(data)
        (src / "target" / f"{stem}.txt").write_text(f"paint the red part of the {suffix} green")
        (src / "mask" / f"{stem}.png").write_bytes(_mask_png(96, 64, np.s_[:, :32]))  # the stored layout
    run(load_config(None, SMALL), src, tmp_path / "store")

    assert not Store(tmp_path / "store").quarantine().num_rows
    for suffix in targets:
        target, mask, meta = _stored(tmp_path / "store", f"stored_{suffix[1:]}", suffix)
        assert target.shape[:2] == mask.shape == (96, 64), suffix
        red = (target[..., 0] > 128) & (target[..., 2] < 128)
        assert red[:28].all() and not red[36:].any(), suffix
        assert ((mask > 128) == red).mean() > 0.97, suffix
        assert "EXIF orientation 6 applied" in meta["conversions"], suffix
        assert "mask turned as its target (EXIF orientation 6)" in meta["conversions"], suffix
