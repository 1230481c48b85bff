"""A store built before the EXIF mask fix (resize-bucket revision 1) rerun with the fixed code: exactly the samples
the fix renders differently (a mask drawn on an EXIF-rotated target's stored pixels) are re-rendered, the others
carried forward, and the table equals a fresh build. Before: revision 1 tables were reported up to date and their
stretched masks reused silently. A revision 1 table without such a sample stays current (no new version)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pipeline.config import load_config
from stages.resize import images_table, rendering, run_lineage
from stages.resize import stage as resize_stage
from store import Store

@pytest.fixture(autouse=True)
def revision_3_code(monkeypatch):
    """The code as of resize-bucket revision 3: the fixes of revisions 2 and 3 are tested as they were made (exact
    counts). Revision 4 re-renders every row of an older version (a transparent colour no stored column tells:
    test_fix_revisions_resize4.py); revision 3's decode equals it on these pictures (no transparent colour).
    Imported (so in force) by the other revision tests that build an older `images` table."""
    monkeypatch.setattr(images_table, "FEATURE_REVISION", 3)
    monkeypatch.setattr(images_table, "FIXES", tuple((r, f) for r, f in images_table.FIXES if r < 3))


SMALL = {"resize.target_area": 64 * 96, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.val_fraction": 0.0}


def _jpeg(orientation: int, seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (64, 96, 3), dtype=np.uint8)
    ex = Image.Exif()
    ex[0x0112] = orientation
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format="JPEG", quality=95, exif=ex.tobytes())
    return b.getvalue()


def _mask(width: int, height: int) -> bytes:
    arr = np.zeros((height, width), np.uint8)
    arr[: height // 3] = 255
    b = io.BytesIO()
    Image.fromarray(arr, "L").save(b, format="PNG")
    return b.getvalue()


def _source(root, with_affected: bool):
    for d in ("target", "mask"):
        (root / d).mkdir(parents=True)
    samples = {f"plain{i}": (_jpeg(1, i), None) for i in range(3)}
    samples["masked"] = (_jpeg(1, 10), _mask(96, 64))  # no rotation
    samples["shown"] = (_jpeg(6, 11), _mask(64, 96))  # rotated, mask of the shown layout: unchanged by the fix
    if with_affected:
        samples["stored"] = (_jpeg(6, 12), _mask(96, 64))  # rotated, mask of the stored layout: the fix's case
    for stem, (target, mask) in samples.items():
        (root / "target" / f"{stem}.jpg").write_bytes(target)
        (root / "target" / f"{stem}.txt").write_text(f"edit {stem}")
        if mask is not None:
            (root / "mask" / f"{stem}.png").write_bytes(mask)
    return len(samples)


def _build_before_fix(monkeypatch, cfg, src, store):
    """What revision 1 wrote: the stretched mask, its lineage (and no record of the lineage before fixes)."""
    with monkeypatch.context() as m:
        m.setattr(images_table, "FEATURE_REVISION", 1)
        m.setattr(rendering, "_drawn_on_stored_pixels", lambda *a: False)
        m.setattr(rendering, "_check_mask_aspect", lambda *a: None)  # it stretched any mask (since: bad-mask)
        real_schema = run_lineage.images_schema

        def old_schema(*a, **k):
            schema = real_schema(*a, **k)
            attrs = {n: v for n, v in schema.attrs.items()
                     if n not in ("feature_lineage_before_fixes", "code_version_before_fixes")}
            return type(schema)(name=schema.name, lineage=schema.lineage, fields=schema.fields, attrs=attrs)

        m.setattr(run_lineage, "images_schema", old_schema)
        return resize_stage.run(cfg, src, store)


def _contents(store) -> dict:
    with Store(store).reader("images") as r:
        return {k: (r.files(k), {c: v for c, v in r.meta(k).items() if c != "source"}) for k in r.keys()}


def test_only_the_samples_the_mask_fix_changes_are_rerendered(monkeypatch, tmp_path):
    cfg = load_config(None, SMALL)
    n = _source(tmp_path / "src", with_affected=True)
    old = _build_before_fix(monkeypatch, cfg, tmp_path / "src", tmp_path / "store")
    assert old.written == n

    rerun = resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    assert not rerun.up_to_date and rerun.version == old.version + 1
    assert not list((tmp_path / "store" / "images").glob("*.unchanged.json"))  # only a "none changed" is kept
    assert (rerun.written, rerun.reused) == (1, n - 1)  # the stored-layout mask only

    resize_stage.run(cfg, tmp_path / "src", tmp_path / "fresh")
    assert _contents(tmp_path / "store") == _contents(tmp_path / "fresh")
    assert resize_stage.run(cfg, tmp_path / "src", tmp_path / "store").up_to_date


def test_a_table_the_fix_leaves_unchanged_stays_current(monkeypatch, tmp_path):
    cfg = load_config(None, SMALL)
    _source(tmp_path / "src", with_affected=False)
    old = _build_before_fix(monkeypatch, cfg, tmp_path / "src", tmp_path / "store")
    rerun = resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    assert rerun.up_to_date and rerun.version == old.version

    # The scan's answer is kept with the version: a rerun of the unchanged store reads no row's metadata.
    import json

    from store.row_rule import RowRule

    record = tmp_path / "store" / "images" / f"v{old.version}.unchanged.json"
    scanned = []
    columns = ("has_mask", "conversions")  # (a rule is asked once per distinct value of these: store/row_rule.py)
    monkeypatch.setattr(images_table, "FIXES", tuple((r, RowRule(lambda row: scanned.append(row) or False, columns))
                                                     for r, _ in images_table.FIXES))
    again = resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    assert again.up_to_date and again.version == old.version and scanned == []
    # a record of another manifest (a version rebuilt under this number) is not trusted: scanned again
    record.write_text(json.dumps({**json.loads(record.read_text()), "version_id": f"v{old.version}-0123456789abcdef"}))
    assert resize_stage.run(cfg, tmp_path / "src", tmp_path / "store").up_to_date and scanned
    assert json.loads(record.read_text())["version_id"] == Store(tmp_path / "store").version_id("images", old.version)
    # nor is one answered for another lineage: a later fix (revision 4, its predicate saying "changed") scans the
    # version again and re-renders, never trusting the "none changed" its predecessor's scan recorded
    monkeypatch.setattr(images_table, "FEATURE_REVISION", 4)
    monkeypatch.setattr(images_table, "FIXES", (*images_table.FIXES,
                                                (3, RowRule(lambda row: scanned.append(row) or True, columns))))
    later = resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    assert not later.up_to_date and later.version == old.version + 1 and later.written == old.written
