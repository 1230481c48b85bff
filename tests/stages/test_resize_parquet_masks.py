"""A parquet source's edit masks and controls are never dropped unsaid: a column named `mask` is read as the mask
when resize.columns.mask is unset ('' reads none), a store made before that rule from such a file is rendered anew
(its masked samples re-rendered, the rest carried), and a column of image bytes no setting reads is named in the
summary."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import load_config
from pipeline.demo_data import generate_samples
from schemas.errors import UserError
from stages.resize import known_tars, parquet_source
from stages.resize.stage import run
from store import Store

SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.max_controls": 3}
N = 12


def cfg(**columns):
    return load_config(None, {**SMALL, **{f"resize.columns.{k}": v for k, v in columns.items()}})


def _masks(store) -> dict[str, tuple[bool, str]]:
    """source row number -> (has_mask, mask_sha256) of the images table."""
    r = Store(store, create=False).reader("images")
    try:
        return {r.meta(k)["source"].rsplit(":", 1)[1]: (r.meta(k)["has_mask"], r.meta(k)["mask_sha256"])
                for k in r.keys()}
    finally:
        r.close()


def _sha(b: bytes | None) -> str:
    return hashlib.sha256(b).hexdigest() if b is not None else ""


def test_the_demo_parquet_with_masks_round_trips_its_masks_by_default(tmp_path):
    out = tmp_path / "demo"
    result = CliRunner().invoke(app, ["make-demo-data", str(out), "--n", str(N), "--format", "parquet", "--max-controls", "2",
                                      "--with-masks", "--seed", "3"])
    assert result.exit_code == 0, result.output
    ss = list(generate_samples(n=N, max_controls=2, seed=3, with_masks=True))
    s = run(cfg(), out, tmp_path / "store")  # no resize.columns.mask set
    assert s.written == N and not s.quarantined
    got = _masks(tmp_path / "store")
    assert sorted(got.values()) == sorted((True, _sha(x.mask)) for x in ss)
    assert "column 'mask' read as the edit mask" in str(s)
    # '' reads none: the masks left out, said
    s = run(cfg(mask=""), out, tmp_path / "store-none")
    assert not any(m for m, _ in _masks(tmp_path / "store-none").values())
    assert "'mask'" in str(s) and "not read" in str(s)


def _rows(n: int, with_masks: bool):
    return list(generate_samples(n=n, max_controls=2, seed=7, with_masks=with_masks))


def _table(samples, **extra) -> pa.Table:
    """A parquet source's columns: target, controls (one list column), caption, and `extra` ones."""
    return pa.table({"target": pa.array([x.target for x in samples], pa.binary()),
                     "controls": pa.array([x.controls for x in samples], pa.list_(pa.binary())),
                     "caption": pa.array([x.caption for x in samples]), **extra})


def test_a_mask_column_is_read_and_an_unmapped_control_column_named(tmp_path):
    ss = _rows(N, True)
    masks = [x.mask if i % 2 else None for i, x in enumerate(ss)]  # half the rows without a mask
    pq.write_table(pa.table({
        "target": pa.array([x.target for x in ss], pa.binary()),
        "control": pa.array([x.controls[0] if x.controls else None for x in ss], pa.binary()),
        "control_2": pa.array([x.controls[1] if len(x.controls) > 1 else None for x in ss], pa.binary()),
        "caption": pa.array([x.caption for x in ss]),
        "mask": pa.array(masks, pa.binary()),
    }), tmp_path / "d.parquet")
    s = run(cfg(references=["control"]), tmp_path / "d.parquet", tmp_path / "store")
    assert s.written == N and not s.quarantined
    got = _masks(tmp_path / "store")
    assert got == {str(i): (m is not None, _sha(m)) for i, m in enumerate(masks)}
    line = next(n for n in str(s).splitlines() if "not read" in n)
    assert "'control_2'" in line and "resize.columns.references" in line and "'mask'" not in line
    # mapped: nothing named, the second controls read
    s = run(cfg(references=["control", "control_2"]), tmp_path / "d.parquet", tmp_path / "store2")
    assert "not read" not in str(s) and s.controls[2] == sum(len(x.controls) > 1 for x in ss)


def test_an_unread_binary_column_of_no_pictures_is_not_named_as_image_bytes(tmp_path):
    """The line naming unread image columns named every binary column: an embeddings column stored as bytes was
    called image bytes, with advice to map it as a control or mask. Its first values' headers (Pillow, nothing
    decoded) tell it apart now; an unread column of pictures is still named."""
    import numpy as np

    ss = _rows(N, False)
    rng = np.random.default_rng(0)
    embeddings = [rng.standard_normal(64).astype(np.float32).tobytes() for _ in ss]
    pq.write_table(_table(ss, embedding=pa.array(embeddings, pa.binary()),
                          thumbnail=pa.array([x.target for x in ss], pa.binary())), tmp_path / "d.parquet")
    s = run(cfg(), tmp_path / "d.parquet", tmp_path / "store")
    assert s.written == N
    line = next(n for n in str(s).splitlines() if "not read" in n)
    assert "'thumbnail'" in line and "'embedding'" not in line, line


def test_a_store_made_before_the_mask_rule_is_not_kept_silently(tmp_path, monkeypatch):
    ss = _rows(N, True)
    masks = [x.mask if i % 3 == 0 else None for i, x in enumerate(ss)]
    pq.write_table(_table(ss, mask=pa.array(masks, pa.binary())), tmp_path / "d.parquet")
    # as before the rule: an unset mask column read nothing (lineage and source-parquet note as then recorded)
    monkeypatch.setattr(parquet_source, "MASK_COLUMN", "no such column", raising=False)
    monkeypatch.setattr(known_tars, "MASK_RULE", None)  # its note written before the rule
    old = run(cfg(), tmp_path / "d.parquet", tmp_path / "store")
    assert old.written == N and not any(m for m, _ in _masks(tmp_path / "store").values())
    monkeypatch.undo()
    s = run(cfg(), tmp_path / "d.parquet", tmp_path / "store")
    assert not s.up_to_date
    masked = sum(m is not None for m in masks)
    assert (s.written, s.reused) == (masked, N - masked)  # only the masked samples rendered again
    assert _masks(tmp_path / "store") == {str(i): (m is not None, _sha(m)) for i, m in enumerate(masks)}
    assert run(cfg(), tmp_path / "d.parquet", tmp_path / "store").up_to_date
    # '' (no masks) over the old store: another setting, its samples carried, none with a mask
    monkeypatch.setattr(parquet_source, "MASK_COLUMN", "no such column", raising=False)
    monkeypatch.setattr(known_tars, "MASK_RULE", None)
    run(cfg(), tmp_path / "d.parquet", tmp_path / "store-old")
    monkeypatch.undo()
    s = run(cfg(mask=""), tmp_path / "d.parquet", tmp_path / "store-old")
    assert s.written == 0 and not any(m for m, _ in _masks(tmp_path / "store-old").values())


def test_a_source_without_a_mask_column_keeps_its_lineage(tmp_path):
    ss = _rows(N, False)
    # a column `mask` holding no image: not read as one
    pq.write_table(_table(ss, mask=pa.array([len(x.controls) for x in ss])), tmp_path / "d.parquet")
    s = run(cfg(), tmp_path / "d.parquet", tmp_path / "store")
    assert s.written == N and "edit mask" not in str(s) and "not read" not in str(s)
    # resolved as unset: the lineage of a store made before the rule
    assert parquet_source.columns_in_force(tmp_path / "d.parquet", cfg().resize.columns) == cfg().resize.columns


def test_a_mask_column_no_file_has_is_one_line_and_no_store(tmp_path):
    ss = _rows(4, True)
    (tmp_path / "src").mkdir()
    for name, part in (("a.parquet", ss[:2]), ("b.parquet", ss[2:])):  # the mask column in one file of two
        extra = {"mask_img": pa.array([x.mask for x in part], pa.binary())} if name == "a.parquet" else {}
        pq.write_table(_table(part, **extra), tmp_path / "src" / name)
    with pytest.raises(UserError) as e:
        run(cfg(mask="mask_image"), tmp_path / "src", tmp_path / "store")
    assert "\n" not in str(e.value) and "'mask_image'" in str(e.value) and "mask_img" in str(e.value)
    assert not (tmp_path / "store").exists()  # refused before a store is made
    # the column one file has: its rows masked, the other file's not
    run(cfg(mask="mask_img"), tmp_path / "src", tmp_path / "store")
    assert _a_parquets_rows_alone_masked(tmp_path)


def _a_parquets_rows_alone_masked(tmp_path) -> bool:
    """The `images` table of tmp_path/store has masks on the rows of src/a.parquet (two) and on none of
    src/b.parquet's (two)."""
    with Store(tmp_path / "store", create=False).reader("images") as r:
        got = {r.meta(k)["source"]: r.meta(k)["has_mask"] for k in r.keys()}
    return got == {f"{tmp_path / 'src' / f}:{i}": f == "a.parquet" for f in ("a.parquet", "b.parquet") for i in (0, 1)}


def test_an_unset_mask_reads_the_files_holding_mask_images_and_no_other(tmp_path):
    # files of one source differing in what their `mask` column holds: unset, the one with image bytes is read as
    # the mask, the one with numbers has no masks (it was refused as if resize.columns.mask named it)
    ss = _rows(4, True)
    (tmp_path / "src").mkdir()
    for name, part in (("a.parquet", ss[:2]), ("b.parquet", ss[2:])):
        mask = pa.array([x.mask for x in part], pa.binary()) if name == "a.parquet" else pa.array([1, 0])
        pq.write_table(_table(part, mask=mask), tmp_path / "src" / name)
    s = run(cfg(), tmp_path / "src", tmp_path / "store")
    assert s.written == 4 and not s.quarantined
    assert _a_parquets_rows_alone_masked(tmp_path)
    # an explicit setting naming a column of numbers is still refused
    with pytest.raises(UserError, match="not image bytes"):
        run(cfg(mask="mask"), tmp_path / "src", tmp_path / "store2")


@pytest.mark.parametrize("with_masks", [True, False])
def test_an_up_to_date_rerun_reads_no_footer(tmp_path, monkeypatch, with_masks):
    # the unset mask column is resolved from the version of this very listing, not from every file's footer: at a
    # URL source a range request per file per rerun (before the rule: none)
    ss = _rows(4, True)
    (tmp_path / "src").mkdir()
    for name, part in (("a.parquet", ss[:2]), ("b.parquet", ss[2:])):
        extra = {"mask": pa.array([x.mask for x in part], pa.binary())} if with_masks else {}
        pq.write_table(_table(part, **extra), tmp_path / "src" / name)
    first = run(cfg(), tmp_path / "src", tmp_path / "store")
    assert first.written == 4 and (_masks(tmp_path / "store")["0"][0] is with_masks)
    reads = []
    real = pq.read_metadata
    monkeypatch.setattr(pq, "read_metadata", lambda *a, **k: reads.append(a) or real(*a, **k))
    again = run(cfg(), tmp_path / "src", tmp_path / "store")
    assert again.up_to_date and again.version == first.version and reads == []
    assert ("column 'mask' read as the edit mask" in str(again)) is with_masks
