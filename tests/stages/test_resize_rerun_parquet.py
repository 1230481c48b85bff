"""A resize-bucket rerun over a parquet source reads only what it must (stages/resize/known_tars.py, parquet files
by the tars' rules): a local file unchanged since the newest version (its cached sha256 the recorded one, every row
of it a row there, read under the same resize.columns) is not read beyond its footer, its rows carried by their
recorded keys; a changed file is read whole; another column mapping carries nothing. The table equals a fresh
run's (rows, bytes, quarantine)."""

from __future__ import annotations

import builtins
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.config import load_config
from stages.resize import parquet_source, stage
from stages.resize.known_tars import PARQUET_NOTE
from store import Store
from store.remote import is_url
from store.version_notes import read_note
from store.writer import TableWriter
from tests.stages.read_counter import count_reads_under
from tests.stages.test_resize_rerun_reads import SMALL, _quarantine, _rows

ROWS = 8
FOOTERS = 3 * 65536  # pyarrow reads a 64 KiB tail per open: the bar's row count, the column check, a reread


def _png(rng: np.random.Generator, side: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _write(path: Path, seed: int, captions: list[str] | None = None) -> None:
    """ROWS rows: a noise target (the bytes of the file), no controls, a caption and a second text column."""
    rng = np.random.default_rng(seed)
    captions = captions or [f"edit {seed} {i}" for i in range(ROWS)]
    pq.write_table(pa.table({
        "target": pa.array([_png(rng, 320) for _ in range(ROWS)], pa.binary()),
        "controls": pa.array([[] for _ in range(ROWS)], pa.list_(pa.binary())),
        "caption": pa.array(captions),
        "other": pa.array([f"another text {seed} {i}" for i in range(ROWS)]),
    }), path, row_group_size=3)


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        _write(src / f"part-{i}.parquet", seed=i)
    return src


def _counting(monkeypatch, src: Path):
    """{file name: bytes read}: Python's open (the listing hash) and pyarrow's reads, given a Python file."""
    counts = count_reads_under(monkeypatch, src)
    monkeypatch.setattr(parquet_source, "_open", lambda p: p if is_url(p) else builtins.open(p, "rb"))
    return counts


def _same_as_fresh(tmp_path: Path, out: Path, src: Path, over: dict) -> None:
    fresh = tmp_path / f"fresh{len(list(tmp_path.glob('fresh*')))}"
    stage.run(load_config(None, {**SMALL, **over}), src, fresh)
    assert _rows(Store(out)) == _rows(Store(fresh))
    assert _quarantine(Store(out)) == _quarantine(Store(fresh))


def test_an_unchanged_parquet_file_is_not_read_on_a_val_fraction_rerun(tmp_path: Path, monkeypatch) -> None:
    src, out = _source(tmp_path), tmp_path / "store"
    first = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.1}), src, out)
    assert first.written == 2 * ROWS
    note = read_note(Store(out), "images", first.version, PARQUET_NOTE)
    assert sorted(note["tars"]) == [str(src / "part-0.parquet"), str(src / "part-1.parquet")]

    counts = _counting(monkeypatch, src)
    again = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.5}), src, out)
    assert again.written == 0 and again.reused == 2 * ROWS
    for f in sorted(src.glob("*.parquet")):  # the footers alone (row count, column check); before: every cell
        assert f.stat().st_size > 10 * FOOTERS and counts[f.name] <= FOOTERS, (f.name, counts[f.name])
    _same_as_fresh(tmp_path, out, src, {"resize.val_fraction": 0.5})


def test_a_changed_file_alone_is_read_whole(tmp_path: Path, monkeypatch) -> None:
    src, out = _source(tmp_path), tmp_path / "store"
    stage.run(load_config(None, SMALL), src, out)
    _write(src / "part-1.parquet", seed=1, captions=[f"edit 1 {i}" for i in range(ROWS - 1)] + ["changed"])

    counts = _counting(monkeypatch, src)
    again = stage.run(load_config(None, SMALL), src, out)
    assert again.written == 1 and again.reused == 2 * ROWS - 1
    assert counts["part-0.parquet"] <= FOOTERS
    assert counts["part-1.parquet"] > (src / "part-1.parquet").stat().st_size  # hashed, then its cells read
    _same_as_fresh(tmp_path, out, src, {})


def test_another_column_mapping_carries_nothing(tmp_path: Path, monkeypatch) -> None:
    """resize.columns is no render setting: a note of another mapping must not offer its rows (their keys hash
    other cells)."""
    src, out = _source(tmp_path), tmp_path / "store"
    stage.run(load_config(None, SMALL), src, out)
    counts = _counting(monkeypatch, src)
    again = stage.run(load_config(None, {**SMALL, "resize.columns.instruction": "other"}), src, out)
    assert again.written == 2 * ROWS
    for f in sorted(src.glob("*.parquet")):
        assert counts[f.name] > 0.9 * f.stat().st_size
    _same_as_fresh(tmp_path, out, src, {"resize.columns.instruction": "other"})


def test_a_run_killed_before_its_commit_records_no_file(tmp_path: Path, monkeypatch) -> None:
    src, out = _source(tmp_path), tmp_path / "store"
    stage.run(load_config(None, SMALL), src, out)
    _write(src / "part-1.parquet", seed=7)

    class Killed(BaseException):
        pass

    def commit(*a, **k):
        raise Killed
    with monkeypatch.context() as m:
        m.setattr(TableWriter, "commit", commit)
        with pytest.raises(Killed):
            stage.run(load_config(None, SMALL), src, out)
    assert read_note(Store(out), "images", 2, PARQUET_NOTE) is None
    counts = _counting(monkeypatch, src)
    again = stage.run(load_config(None, SMALL), src, out)
    assert again.version == 2 and again.written == 0 and again.resumed + again.reused == 2 * ROWS
    assert counts["part-0.parquet"] <= FOOTERS
    assert sorted(read_note(Store(out), "images", 2, PARQUET_NOTE)["tars"]) == \
        [str(src / "part-0.parquet"), str(src / "part-1.parquet")]
    _same_as_fresh(tmp_path, out, src, {})



def test_a_carried_row_met_after_its_copy_is_read_from_its_row_group(tmp_path: Path, monkeypatch) -> None:
    """A file added before an unchanged one holds a copy of one of its rows: that row is judged from its bytes
    (read from its row group alone, `_RowGroups`), a duplicate as in a fresh run; the file's other rows carried."""
    src, out = _source(tmp_path), tmp_path / "store"
    stage.run(load_config(None, SMALL), src, out)
    copy = pq.read_table(src / "part-1.parquet").slice(4, 1)
    pq.write_table(copy, src / "part-05.parquet")  # sorts before part-1.parquet

    counts = _counting(monkeypatch, src)
    again = stage.run(load_config(None, SMALL), src, out)
    assert again.written == 0 and again.reused == 2 * ROWS and again.quarantined == {"duplicate": 1}
    size = (src / "part-1.parquet").stat().st_size
    assert FOOTERS < counts["part-1.parquet"] < FOOTERS + size / 2  # one row group of 3 rows, not the file
    _same_as_fresh(tmp_path, out, src, {})


def test_files_at_a_url_are_judged_by_their_size_and_etag(s3_env, tmp_path: Path, monkeypatch) -> None:
    """Parquet objects on the S3 test server, a val_fraction rerun: an unchanged object is carried by the identity
    the listing hash uses (URL, size, ETag), its footer alone fetched (before: every image cell again, a download
    of the dataset); an object put again with other rows is read whole. The table equals a fresh run's."""
    from collections import Counter

    import s3fs

    src, out = _source(tmp_path), tmp_path / "store"
    client = s3_env.client()
    for f in sorted(src.glob("*.parquet")):
        client.put_object(Bucket=s3_env.bucket, Key=f"data/{f.name}", Body=f.read_bytes())
    url = f"s3://{s3_env.bucket}/data"
    assert stage.run(load_config(None, SMALL), url, out).written == 2 * ROWS
    new = pq.read_table(src / "part-1.parquet")  # part-1 put again with other captions: other samples
    pq.write_table(new.set_column(2, "caption", pa.array([f"new {i}" for i in range(ROWS)])), tmp_path / "new.parquet")
    client.put_object(Bucket=s3_env.bucket, Key="data/part-1.parquet", Body=(tmp_path / "new.parquet").read_bytes())

    fetched, real = Counter(), s3fs.core.S3File._fetch_range

    def fetch(self, start, end):  # the bytes asked of the server, per object
        fetched[self.path.rsplit("/", 1)[-1]] += end - start
        return real(self, start, end)
    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", fetch)
    over = {"resize.val_fraction": 0.5}
    again = stage.run(load_config(None, {**SMALL, **over}), url, out)
    assert (again.written, again.reused) == (ROWS, ROWS)
    size = (src / "part-0.parquet").stat().st_size
    assert size > 10 * FOOTERS and fetched["part-0.parquet"] <= FOOTERS / 3, fetched
    assert fetched["part-1.parquet"] > 0.9 * (tmp_path / "new.parquet").stat().st_size, fetched
    fresh = tmp_path / "fresh"
    stage.run(load_config(None, {**SMALL, **over}), url, fresh)
    assert _rows(Store(out)) == _rows(Store(fresh)) and _quarantine(Store(out)) == _quarantine(Store(fresh))


def test_a_row_to_check_under_a_lowered_pixel_limit_is_read_from_its_row_group(tmp_path: Path, monkeypatch) -> None:
    """resize.max_image_pixels lowered under one row's target: that row's headers are read from its row group's
    image cells (parquet_source._RowGroups), the file carried, not read whole with every row judged from its
    bytes (before: the whole file once a row of it needed a check). Quarantined as a fresh run quarantines it."""
    src, out = tmp_path / "src", tmp_path / "store"
    src.mkdir()
    rng = np.random.default_rng(5)
    pq.write_table(pa.table({
        "target": pa.array([_png(rng, 400 if i == 4 else 320) for i in range(ROWS)], pa.binary()),
        "controls": pa.array([[] for _ in range(ROWS)], pa.list_(pa.binary())),
        "caption": pa.array([f"edit {i}" for i in range(ROWS)]),
    }), src / "part-0.parquet", row_group_size=3)
    stage.run(load_config(None, SMALL), src, out)
    lowered = {"resize.max_image_pixels": 400 * 400 - 1}

    counts = _counting(monkeypatch, src)
    again = stage.run(load_config(None, {**SMALL, **lowered}), src, out)
    assert again.quarantined == {"image-too-large": 1} and again.written == 0 and again.reused == ROWS - 1
    size = (src / "part-0.parquet").stat().st_size
    assert FOOTERS < counts["part-0.parquet"] < FOOTERS + size / 2  # row group 1 (rows 3-5), once: not the file
    _same_as_fresh(tmp_path, out, src, lowered)


def _resized_header(png: bytes, side: int) -> bytes:
    """The PNG with its IHDR saying `side` x `side` (its CRC made again): the same length, another header."""
    import struct
    import zlib

    ihdr = b"IHDR" + struct.pack(">II", side, side) + png[24:29]
    return png[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + png[33:]

