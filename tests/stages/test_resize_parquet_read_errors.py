"""A local parquet file whose read fails (EIO: a bad sector; not a corrupt file) is one `read-error` row for the rows
it kept from being read, their range named from the footer (one row for the file when the footer itself fails), the file
marked unread (stages/resize/parquet_source.py `_unread_rows`, `_unopened`): the version does not count it as read,
and a rerun once the disk reads again adds exactly those rows, the others carried, not rendered again; the store
then equals a clean run's. Before: the rows from the failure on were `bad-source` ("truncated or corrupt") and the
file counted as read, so the next run was "up to date" with them missing. The fault is a bad sector at a chosen
byte of the file object the reader reads (HashedParquet's file on a first read, pyarrow's file when the file was
hashed before)."""

from __future__ import annotations

import errno
import io
import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from models.file_hashes import FileHashes
from pipeline.config import load_config
from stages.resize import hashed_parquet, parquet_source, rendering, stage, webdataset_source
from store import Store
from tests.stages.test_resize_read_errors import _data_offset, _failing_tar, _tars
from tests.stages.test_resize_rerun_parquet import ROWS, _source
from tests.stages.test_resize_rerun_reads import SMALL, _quarantine, _rows

SECTOR = 4096


class _BadSector(io.FileIO):
    """A file whose bytes [at, at + SECTOR) cannot be read: every read touching them fails with EIO."""

    def __init__(self, path, at: int) -> None:
        super().__init__(path, "rb")
        self.at = at

    def _check(self, n: int) -> None:
        pos = self.tell()
        end = os.fstat(self.fileno()).st_size if n is None or n < 0 else pos + n
        if pos < self.at + SECTOR and end > self.at:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    def read(self, n: int = -1) -> bytes:
        self._check(n)
        return super().read(n)

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, b) -> int:
        self._check(len(b))
        return super().readinto(b)


def _bad_sector(monkeypatch, victim: Path, at: int) -> None:
    """Every read of `victim` (HashedParquet's file, and the file pyarrow reads otherwise) fails at byte `at`."""
    real_open = parquet_source._open

    def opened(path):
        return _BadSector(path, at) if Path(str(path)) == victim else real_open(path)

    def raw_open(path, *a, **k):
        return _BadSector(path, at) if Path(path) == victim else open(path, *a, **k)
    monkeypatch.setattr(parquet_source, "_open", opened)
    monkeypatch.setattr(hashed_parquet, "open", raw_open, raising=False)


def _lineage(out: Path, version: int) -> dict:
    return json.loads((Store(out).version_dir("images", version) / "schema.json").read_text())["lineage"]


@pytest.mark.parametrize("where", ["row-group-1", "footer"])
@pytest.mark.parametrize("hashed_first", [False, True], ids=["first-read", "hashed-first"])
def test_a_parquet_read_error_quarantines_each_unread_row_and_a_rerun_adds_them(tmp_path, monkeypatch, where,
                                                                                hashed_first) -> None:
    src, out, clean = _source(tmp_path), tmp_path / "store", tmp_path / "clean"
    victim = src / "part-1.parquet"
    if hashed_first:  # the files in the hash cache: not hashed as read, pyarrow reads the file itself
        with FileHashes() as h:
            for f in sorted(src.glob("*.parquet")):
                h.sha256(f)
    monkeypatch.setattr(parquet_source, "BATCH_ROWS", 3)  # = the row groups: batch 2 is the first to need group 1
    md = pq.read_metadata(victim)
    at = md.row_group(1).column(0).data_page_offset + 100 if where == "row-group-1" else \
        victim.stat().st_size - 100
    cfg = load_config(None, SMALL)
    with monkeypatch.context() as m:
        _bad_sector(m, victim, at)
        first = stage.run(cfg, src, out)
    q = {r["source"]: r for r in Store(out).quarantine().to_pylist()}
    unread = [f"{victim}:3-{ROWS - 1}"] if where == "row-group-1" else [str(victim)]  # one row for the range
    assert sorted(q) == sorted(unread)
    assert {r["reason"] for r in q.values()} == {"read-error"}
    assert all(str(victim) in r["detail"] and "Input/output error" in r["detail"] for r in q.values())
    assert first.written == 2 * ROWS - (ROWS - 3 if where == "row-group-1" else ROWS)
    assert "rerun" in str(first)

    rendered = []
    real_render = rendering.render
    monkeypatch.setattr(rendering, "render", lambda rec, *a, **k: rendered.append(rec.source) or real_render(rec, *a, **k))
    again = stage.run(cfg, src, out)  # the disk reads again
    assert not again.up_to_date, "rows a read error kept out, and the run calls the version up to date"
    assert again.written == 2 * ROWS - first.written and again.reused == first.written and not again.quarantined
    # exactly the rows not read before (the footer's failure: all of the file's) rendered, the others carried
    assert sorted(rendered) == sorted(f"{victim}:{i}" for i in range(3 if where == "row-group-1" else 0, ROWS))
    assert stage.run(cfg, src, out).up_to_date

    stage.run(cfg, src, clean)
    assert _rows(Store(out)) == _rows(Store(clean)) and _quarantine(Store(clean)) == []
    assert _lineage(out, again.version) == _lineage(clean, 1)  # the lineage of the source read whole


def test_a_carried_row_read_again_with_a_read_error_is_a_read_error(tmp_path, monkeypatch) -> None:
    """A row of a file carried unread, read after all (a duplicate's check) while the disk fails: `read-error`, the
    file marked unread (was `bad-source`, "changed while this run read it")."""
    from schemas.config import ParquetColumns

    src = _source(tmp_path)
    victim = src / "part-0.parquet"
    lay = parquet_source._layout(pq.read_schema(victim), ParquetColumns(), victim)
    at = pq.read_metadata(victim).row_group(1).column(0).data_page_offset + 100
    _bad_sector(monkeypatch, victim, at)
    s = parquet_source._RowGroups(victim, lay, 1 << 30).row(4)
    assert (s.problem_kind, s.unread, s.source) == ("read-error", str(victim), f"{victim}:4")
    assert "Input/output error" in s.problem


def test_a_carried_tar_read_again_whose_headers_fail_too_is_a_read_error(tmp_path, monkeypatch) -> None:
    """A sample of a tar carried unread, read after all, where the stream and the header walk past it fail: the
    sample is `read-error`, the tar marked unread (was `bad-source` "no longer in the tar", nothing unread)."""
    import tarfile

    src = tmp_path / "src"
    _tars(src, tars=1)
    victim = src / "shard-0.tar"
    _failing_tar(monkeypatch, victim, _data_offset(victim, "s0_1.control.png") + 10)
    real_open = tarfile.open

    def walk(name=None, mode="r", *a, **k):
        if name is not None and Path(name) == victim and mode == "r:":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_open(name, mode, *a, **k)
    monkeypatch.setattr(tarfile, "open", walk)
    s = webdataset_source.reread_tar(str(victim), f"{victim}:s0_2", 1 << 30)
    assert (s.problem_kind, s.unread, s.source) == ("read-error", str(victim), f"{victim}:s0_2")
    assert "Input/output error" in s.problem


def _big_parquet(path, rows: int, group: int):
    """A parquet file of `rows` edit pairs (random PNG targets, no controls) in row groups of `group`."""
    import numpy as np
    import pyarrow as pa
    from PIL import Image

    rng = np.random.default_rng(0)

    def png(i: int) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (48, 48 + i % 7, 3), dtype=np.uint8)).save(buf, format="PNG")
        return buf.getvalue()
    pq.write_table(pa.table({"target": pa.array([png(i) for i in range(rows)], pa.binary()),
                             "controls": pa.array([[] for _ in range(rows)], pa.list_(pa.binary())),
                             "caption": pa.array([f"edit {i}" for i in range(rows)])}), path, row_group_size=group)
    return path


def _big_source(tmp_path, monkeypatch, rows: int, group: int):
    """(TMP/src holding big.parquet, that file, the small-render config) with `_big_parquet(rows, group)` read one
    row group per batch, so a bad sector in row group g keeps out the rows from g * group on."""
    src = tmp_path / "src"
    src.mkdir()
    victim = _big_parquet(src / "big.parquet", rows, group)
    monkeypatch.setattr(parquet_source, "BATCH_ROWS", group)
    return src, victim, load_config(None, SMALL)


def test_the_rows_an_early_read_error_keeps_out_are_one_quarantine_row_counting_them(tmp_path, monkeypatch) -> None:
    """A read error early in a large file: one `read-error` row for the unread row range (its `samples` column the
    count), not one per row (a million rows for a million-row file); the summary, its JSON and `store inspect`
    still count samples. The rerun, the disk reading again, adds exactly those rows."""
    from store.inspect import describe, render

    rows, group = 60, 10
    src, victim, cfg = _big_source(tmp_path, monkeypatch, rows, group)
    out, clean = tmp_path / "store", tmp_path / "clean"
    with monkeypatch.context() as m:
        _bad_sector(m, victim, pq.read_metadata(victim).row_group(1).column(0).data_page_offset + 100)
        first = stage.run(cfg, src, out)
    unread = rows - group
    [q] = Store(out).quarantine().to_pylist()
    assert (q["source"], q["reason"], q["samples"]) == (f"{victim}:{group}-{rows - 1}", "read-error", str(unread))
    assert f"rows {group} to {rows - 1} ({unread} rows)" in q["detail"] and "Input/output error" in q["detail"]
    assert first.written == group and first.quarantined["read-error"] == unread
    assert first.to_json()["quarantined"] == unread and f"could not read {unread} sample(s)" in str(first)
    info = describe(out)
    assert info["quarantine"]["rows"] == 1 and info["quarantine"]["samples"] == unread
    assert info["quarantine"]["by_reason"] == {"read-error": unread}
    assert f"quarantine: 1 row ({unread} samples)" in render(info)

    again = stage.run(cfg, src, out)  # the disk reads again: exactly the unread rows added
    assert again.written == unread and again.reused == group and not again.quarantined
    stage.run(cfg, src, clean)
    assert _rows(Store(out)) == _rows(Store(clean))


def test_a_flaky_disk_recording_overlapping_ranges_counts_each_unread_row_once(tmp_path, monkeypatch) -> None:
    """Each rerun of a disk failing at another row group records another range of the same file (10-59, 20-59,
    30-59: every row equal to none before): `store inspect` counts the rows ever kept out, 50 of a 60-row file, not
    the 120 the ranges add up to; a row per input that a store written before ranges holds is one of them too."""
    import pyarrow as pa

    from store.inspect import describe
    from store.quarantine import samples_by_reason

    rows, group = 60, 10
    src, victim, cfg = _big_source(tmp_path, monkeypatch, rows, group)
    out = tmp_path / "store"
    for g in (1, 2, 3):
        with monkeypatch.context() as m:
            _bad_sector(m, victim, pq.read_metadata(victim).row_group(g).column(0).data_page_offset + 100)
            assert stage.run(cfg, src, out).quarantined["read-error"] == rows - g * group  # this run's own
    q = Store(out).quarantine()
    assert sorted(s.rsplit("/", 1)[-1] for s in q.column("source").to_pylist()) == \
        ["big.parquet:10-59", "big.parquet:20-59", "big.parquet:30-59"]
    unread = rows - group
    assert describe(out)["quarantine"] == {"rows": 3, "samples": unread, "by_reason": {"read-error": unread}}

    # the rows the code before ranges wrote for the first failure (one per row, no `samples` column), then a range
    old = pa.table({"source": [f"{victim}:{i}" for i in range(group, rows)], "reason": ["read-error"] * (rows - group)})
    both = pa.concat_tables([old, q.select(["source", "reason", "samples"])], promote_options="permissive")
    assert samples_by_reason(both) == {"read-error": rows - group}


def test_a_resumed_run_failing_earlier_counts_the_rows_written_before_as_kept(tmp_path, monkeypatch) -> None:
    """The first run fails reading row group 4 and is killed before its commit (rows 0-39 in committed shards);
    the resumed run's disk fails at row group 1. Rows 10-39 are in the version it commits: kept from the
    interrupted run, not read again; its read-error row and summary count rows 40-59 only (before: 50 rows "could
    not be read", 30 of them in the table). The next run, the disk reading again, adds exactly those 20."""
    from store.writer import TableWriter

    rows, group = 60, 10
    src, victim, cfg = _big_source(tmp_path, monkeypatch, rows, group)
    out, clean = tmp_path / "store", tmp_path / "clean"
    at = lambda g: pq.read_metadata(victim).row_group(g).column(0).data_page_offset + 100  # noqa: E731

    class Killed(BaseException):
        pass

    def killed(*a, **k):
        raise Killed
    with monkeypatch.context() as m:
        _bad_sector(m, victim, at(4))
        m.setattr(TableWriter, "commit", killed)
        with pytest.raises(Killed):
            stage.run(cfg, src, out)
    rendered = []
    real_render = rendering.render
    with monkeypatch.context() as m:
        _bad_sector(m, victim, at(1))
        m.setattr(rendering, "render", lambda rec, *a, **k: rendered.append(rec.source) or real_render(rec, *a, **k))
        resumed = stage.run(cfg, src, out)
    assert (resumed.written, resumed.resumed, resumed.quarantined["read-error"]) == (0, 40, 20) and not rendered
    assert "could not read 20 sample(s)" in str(resumed) and "40 kept from an interrupted run" in str(resumed)
    with Store(out).reader("images", resumed.version) as r:
        assert sorted(r.meta(k)["source"] for k in r.keys()) == sorted(f"{victim}:{i}" for i in range(40))
    last = Store(out).quarantine().to_pylist()[-1]
    assert (last["source"], last["samples"]) == (f"{victim}:40-59", "20")
    assert "rows 40 to 59 (20 rows)" in last["detail"] and "read error at row 10" in last["detail"]

    again = stage.run(cfg, src, out)  # the disk reads again: the 20 rows added, the 40 carried
    assert (again.written, again.reused, dict(again.quarantined)) == (20, 40, {})
    stage.run(cfg, src, clean)
    assert _rows(Store(out)) == _rows(Store(clean))
