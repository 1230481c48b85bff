"""resize-bucket for Qwen-Image-2.1: RGBA kept with resize.keep_alpha, references resized once in 32s, > 10
references quarantined by the 2.1 config; the switch off leaves earlier tables' lineage as it was."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.config import load_config
from stages.resize.images_table import images_schema
from stages.resize.stage import run
from store import Store

CONFIG = Path(__file__).parents[2] / "configs" / "qwen-image-2.1.yaml"


def _png(im: Image.Image) -> bytes:
    b = io.BytesIO()
    im.save(b, format="PNG")
    return b.getvalue()


def _rgba(w, h, seed=0) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 4), dtype=np.uint8)
    arr[:, : w // 2, 3] = 0
    return Image.fromarray(arr, "RGBA")


def _put(root: Path, stem: str, target: bytes, controls=()) -> None:
    (root / "target").mkdir(parents=True, exist_ok=True)
    (root / "target" / f"{stem}.png").write_bytes(target)
    (root / "target" / f"{stem}.txt").write_text("make it blue")
    for i, c in enumerate(controls):
        d = root / ("control" if i == 0 else f"control_{i}")
        d.mkdir(exist_ok=True)
        (d / f"{stem}.png").write_bytes(c)


def test_keep_alpha_and_reference_sizes_and_eleven_references(tmp_path):
    src = tmp_path / "src"
    _put(src, "a", _png(_rgba(150, 100)), [_png(_rgba(80, 120, 1)), _png(Image.new("RGB", (64, 64), "red"))])
    _put(src, "b", _png(Image.new("RGB", (90, 90), "blue")), [_png(Image.new("RGB", (40, 40), (0, 9, i)))
                                                             for i in range(11)])
    cfg = load_config(CONFIG, {"resize.val_fraction": 0.0})  # keep_alpha: true there
    summary = run(cfg, src, tmp_path / "store")
    assert summary.written == 1 and summary.quarantined == {"control-count": 1}
    images = Store(tmp_path / "store").reader("images")
    (key,) = images.keys()
    files, meta = images.files(key), images.meta(key)
    target = Image.open(io.BytesIO(files["target.png"]))
    assert target.mode == "RGBA" and target.getchannel("A").getextrema() == (0, 255)
    ref0 = Image.open(io.BytesIO(files["control_0.png"]))
    assert ref0.mode == "RGBA"
    assert Image.open(io.BytesIO(files["control_1.png"])).mode == "RGB"  # no alpha: stays RGB
    # each reference once at the reference area keeping its aspect, sides in 32s (the pipeline's calculate_dimensions)
    for (h, w), (sw, sh) in zip(meta["control_sizes"], [(80, 120), (64, 64)]):
        assert h % 32 == 0 and w % 32 == 0 and abs(w / h - sw / sh) < 0.35
    assert meta["control_sizes"][0] == [128, 64]

    # off (the default): composited over white, as before
    off = run(load_config(CONFIG, {"resize.val_fraction": 0.0, "resize.keep_alpha": False}), src, tmp_path / "store-off")
    assert off.written == 1
    r = Store(tmp_path / "store-off").reader("images")
    assert Image.open(io.BytesIO(r.files(r.keys()[0])["target.png"])).mode == "RGB"


def test_switch_off_leaves_the_lineage_as_before():
    cfg = load_config(None, {})
    from schemas.lineage import unhashed_names

    assert "keep_alpha" in unhashed_names(cfg.resize)  # added later, off: in no hash, as before it existed
    a = images_schema(cfg.resize, "listing")
    b = images_schema(load_config(None, {"resize.keep_alpha": True}).resize, "listing")
    assert a.lineage.config_hash != b.lineage.config_hash
    assert "keep_alpha" not in a.attrs["resize"]


def test_the_21_config_writes_no_vl_views_and_edit_plus_refuses_such_a_table(tmp_path, tiny_plus_model):
    """Qwen-Image-2.1 reads control_{i}.png only: with the 2.1 config (resize.vl_views: false) resize renders
    and stores no control_{i}_vl.png (before: one more Lanczos resize + PNG per reference, ~21% more bytes at
    1024² references). An Edit-Plus model reads those views: encode-text refuses such a table in one line before
    loading its encoder. The default (true) leaves earlier tables' lineage as it was."""
    import pytest

    from schemas.errors import UserError
    from schemas.lineage import unhashed_names
    from stages.encode import text as encode_text

    src = tmp_path / "src"
    _put(src, "a", _png(_rgba(150, 100)), [_png(_rgba(80, 120, 1)), _png(Image.new("RGB", (64, 64), "red"))])
    on = run(load_config(CONFIG, {"resize.val_fraction": 0.0, "resize.vl_views": True}), src, tmp_path / "on")
    off = run(load_config(CONFIG, {"resize.val_fraction": 0.0}), src, tmp_path / "off")
    assert on.written == off.written == 1
    with_vl, without = Store(tmp_path / "on").reader("images"), Store(tmp_path / "off").reader("images")
    (key,) = without.keys()
    assert sorted(without.files(key)) == ["control_0.png", "control_1.png", "target.png"]
    assert sorted(with_vl.files(key)) == ["control_0.png", "control_0_vl.png", "control_1.png", "control_1_vl.png",
                                          "target.png"]
    assert without.meta(key)["control_vl_sizes"] == []
    assert "no VL view (resize.vl_views: false)" in off.sizes and "VL view ~384" in on.sizes  # the summary line
    for name in ("target.png", "control_0.png", "control_1.png"):  # what 2.1 reads: the same pixels
        assert without.files(key)[name] == with_vl.files(key)[name]

    with pytest.raises(UserError, match="resize.vl_views: false"):
        encode_text.run(load_config(None, {}), tmp_path / "off", tiny_plus_model)
    assert "vl_views" in unhashed_names(load_config(None, {}).resize)  # default: in no hash, as before it existed
