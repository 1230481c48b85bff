"""A local parquet file whose read fails (EIO: a bad sector; not a corrupt file) is a `read-error` row for each row
it kept from being read, named from the footer (one row for the file when the footer itself fails), the file
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
from stages.resize import hashed_parquet, parquet_source, sources, stage
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
    unread = [f"{victim}:{i}" for i in range(3, ROWS)] if where == "row-group-1" else [str(victim)]
    assert sorted(q) == sorted(unread)
    assert {r["reason"] for r in q.values()} == {"read-error"}
    assert all(str(victim) in r["detail"] and "Input/output error" in r["detail"] for r in q.values())
    assert first.written == 2 * ROWS - (ROWS - 3 if where == "row-group-1" else ROWS)
    assert "rerun" in str(first)

    rendered = []
    real_render = stage.render
    monkeypatch.setattr(stage, "render", lambda rec, *a, **k: rendered.append(rec.source) or real_render(rec, *a, **k))
    again = stage.run(cfg, src, out)  # the disk reads again
    assert not again.up_to_date, "rows a read error kept out, and the run calls the version up to date"
    assert again.written == 2 * ROWS - first.written and again.reused == first.written and not again.quarantined
    # exactly the rows not read before (the footer's failure: all of the file's) rendered, the others carried
    assert sorted(rendered) == sorted(unread if where == "row-group-1" else [f"{victim}:{i}" for i in range(ROWS)])
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
    s = parquet_source._reread_row(victim, 4, lay, 1 << 30)
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
    s = sources._reread_tar(str(victim), f"{victim}:s0_2", 1 << 30)
    assert (s.problem_kind, s.unread, s.source) == ("read-error", str(victim), f"{victim}:s0_2")
    assert "Input/output error" in s.problem
