"""make-demo-data: the three formats read back (through stages.resize.sources) as the same samples; same seed, same bytes."""

from __future__ import annotations

import hashlib
import io
from math import gcd
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.demo_data import make_demo_data
from stages.resize.sources import detect_format, iter_source

N = 12


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def _parsed(root: Path) -> list[tuple]:
    out = []
    for s in iter_source(root):
        assert s.problem is None, s.problem
        out.append((s.target, tuple(s.controls), s.caption, s.mask))
    return out


@pytest.fixture(scope="module")
def demo_sets(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("demo")
    sets = {}
    for fmt in ("folder", "webdataset", "jsonl"):
        make_demo_data(base / fmt, n=N, fmt=fmt, max_controls=3, seed=7, with_masks=True)
        sets[fmt] = base / fmt
    return sets


def test_three_formats_parse_to_the_same_samples(demo_sets):
    parsed = {fmt: _parsed(p) for fmt, p in demo_sets.items()}
    assert {fmt: detect_format(p) for fmt, p in demo_sets.items()} == {f: f for f in demo_sets}
    assert len(parsed["folder"]) == N
    assert parsed["folder"] == parsed["webdataset"] == parsed["jsonl"]
    # the folder's stems are the webdataset keys
    assert [s.name for s in iter_source(demo_sets["folder"])] == [s.name for s in iter_source(demo_sets["webdataset"])]


def test_same_seed_same_bytes_other_seed_differs(tmp_path, demo_sets):
    for fmt in ("folder", "webdataset", "jsonl"):
        make_demo_data(tmp_path / fmt, n=N, fmt=fmt, seed=7, with_masks=True)
        assert _tree_digest(tmp_path / fmt) == _tree_digest(demo_sets[fmt])
    make_demo_data(tmp_path / "other", n=N, fmt="folder", seed=8, with_masks=True)
    assert _tree_digest(tmp_path / "other") != _tree_digest(demo_sets["folder"])


def test_mixed_sizes_aspects_and_control_counts(tmp_path):
    summary = make_demo_data(tmp_path, n=48, fmt="folder", max_controls=3, seed=0)
    samples = list(iter_source(tmp_path))
    sizes = [Image.open(io.BytesIO(s.target)).size for s in samples]
    aspects = {(w // gcd(w, h), h // gcd(w, h)) for w, h in sizes}
    assert len(aspects) >= 5
    assert all(48 <= v <= 320 for wh in sizes for v in wh)
    counts = [len(s.controls) for s in samples]
    assert set(counts) == {0, 1, 2, 3}
    assert all(s.caption and s.caption.decode("utf-8").strip() for s in samples)
    assert all(s.mask is None for s in samples) and not (tmp_path / "mask").exists()
    # extra controls have sizes of their own (multi-resolution controls)
    ctrl_sizes = {Image.open(io.BytesIO(c)).size for s in samples for c in s.controls[1:]}
    assert len(ctrl_sizes) > 3
    assert "48 demo samples" in summary


def test_masks_mark_exactly_the_edited_pixels(demo_sets):
    for s in iter_source(demo_sets["folder"]):
        target = np.asarray(Image.open(io.BytesIO(s.target)).convert("RGB")).astype(int)
        mask = np.asarray(Image.open(io.BytesIO(s.mask)))
        assert mask.shape == target.shape[:2] and set(np.unique(mask)) <= {0, 255}
        if not s.controls:  # generated from text: everything is new
            assert (mask == 255).all()
            continue
        control = np.asarray(Image.open(io.BytesIO(s.controls[0])).convert("RGB")).astype(int)
        changed = (target != control).any(axis=-1)
        assert changed.any(), s.caption
        np.testing.assert_array_equal(mask == 255, changed)


def test_webdataset_shards_read_with_the_stock_library(demo_sets):
    import webdataset as wds

    urls = [str(p) for p in sorted(demo_sets["webdataset"].glob("*.tar"))]
    stock = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
    ours = list(iter_source(demo_sets["webdataset"]))
    assert [d["__key__"] for d in stock] == [s.name for s in ours]
    for d, s in zip(stock, ours):
        assert d["png"] == s.target and d["txt"] == s.caption and d["mask.png"] == s.mask
        assert [d[k] for k in sorted(k for k in d if k.startswith("control"))] == s.controls


def test_cli_writes_the_dataset(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    res = CliRunner().invoke(app, ["make-demo-data", str(tmp_path / "d"), "--n", "4", "--format", "jsonl", "--with-masks"])
    assert res.exit_code == 0, res.output
    assert "wrote 4 demo samples (jsonl, with masks)" in res.output
    assert len(list(iter_source(tmp_path / "d"))) == 4
    bad = CliRunner().invoke(app, ["make-demo-data", str(tmp_path / "e"), "--format", "zip"])
    assert bad.exit_code == 2 and "'zip' is not one of folder" in bad.output, bad.output


def test_generating_the_samples_shows_a_progress_bar(tmp_path, capsys):
    """Drawing the samples is most of the time (~1.5 ms each here: 1M samples are ~25 minutes)."""
    from pipeline.demo_data import make_demo_data

    make_demo_data(tmp_path / "d", n=5)
    assert "demo samples: 100%" in capsys.readouterr().err.replace("\r", "\n")


# sha256 over (relative path, sha256 of the bytes) of every file, n=21 (two tars, three parquet row groups), seed 5,
# as written when all samples were held in memory before writing: streaming them must not change a byte. Parquet:
# the same cells, without the image columns' statistics (whole PNGs as min/max, 25% of the file, held until the
# footer by the writer): its pin moved with that change, not with the streaming.
PINNED = {
    "folder": "1fd81c594f86b118f4772e66e5f5633ca6126ea73a014de2114ffd4f9d4f255d",
    "webdataset": "91d540eeceace6b081e16e26a6bd5e90bdc449186de2d1ecbd72f0a4271be2d7",
    "jsonl": "95b919ba71babc88185e23d81ac58b37d27174cb343f9073faacbb6033ce3821",
    "parquet": "78a846f4980cefb008c5332fcd4a7ba6108aef7876ae61fa8e4749bf605a30d4",
}


@pytest.mark.parametrize("fmt", sorted(PINNED))
def test_streamed_writers_write_the_same_bytes_as_before(tmp_path, fmt):
    summary = make_demo_data(tmp_path / fmt, n=21, fmt=fmt, max_controls=3, seed=5, with_masks=fmt != "jsonl")
    h = hashlib.sha256()
    for rel, digest in _tree_digest(tmp_path / fmt).items():
        h.update(rel.encode() + b"\0" + bytes.fromhex(digest))
    assert h.hexdigest() == PINNED[fmt]
    if fmt == "parquet":  # the cells are the generated bytes; only the caption has statistics
        import pyarrow.parquet as pq

        from pipeline.demo_data import generate_samples

        f = pq.ParquetFile(tmp_path / fmt / "data" / "train-00000-of-00001.parquet")
        rows = f.read().to_pylist()
        for row, s in zip(rows, generate_samples(21, max_controls=3, seed=5, with_masks=True), strict=True):
            assert (row["target"]["bytes"], [c["bytes"] for c in row["controls"]], row["caption"],
                    row["mask"]["bytes"]) == (s.target, s.controls, s.caption, s.mask)
        meta = f.metadata.row_group(0)
        stats = {meta.column(i).path_in_schema: meta.column(i).is_stats_set for i in range(meta.num_columns)}
        assert stats.pop("caption") and not any(stats.values()), stats
    assert summary.endswith("controls per sample {0: 6, 1: 5, 2: 5, 3: 5}, 9 target aspect ratios, sides 52..320 px")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_memory_does_not_grow_with_the_sample_count(tmp_path, fmt):
    """Peak Python allocations writing 240 samples stay within a fraction of those 200 extra samples' bytes above
    writing 40 (holding every sample until the end made the peak grow by all of them: ~1.8 GB at 1M)."""
    import tracemalloc

    from pipeline.demo_data import generate_samples

    def peak(n: int) -> int:
        tracemalloc.start()
        try:
            make_demo_data(tmp_path / f"{fmt}{n}", n=n, fmt=fmt, max_controls=3, seed=1, with_masks=True)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    make_demo_data(tmp_path / "warm", n=2, fmt=fmt)  # imports (store, pyarrow) allocate once, outside the measure
    extra = sum(len(s.target) + sum(map(len, s.controls)) + len(s.mask or b"")
                for s in list(generate_samples(240, max_controls=3, seed=1, with_masks=True))[40:])
    assert peak(240) - peak(40) < extra // 4
