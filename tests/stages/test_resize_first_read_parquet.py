"""A first resize-bucket run over local parquet files reads each file once (stages/resize/first_read.py, the tars'
mechanism; stages/resize/hashed_parquet.py): its sha256 is taken from the bytes pyarrow reads, through one
sequential pass (before: hashed whole for the listing, then its cells read: twice the file). The version commits
under the lineage a hash-first run gives; a run SIGKILLed at each step of settling it resumes; a file changed
while read is read again by the next run. Each file's footer is read once a run (before: three times)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.config import load_config
from stages.resize import first_read, parquet_source, stage
from stages.resize.known_tars import PARQUET_NOTE
from store import Store
from store.version_notes import read_note
from tests.stages.test_resize_rerun_parquet import ROWS, _counting, _source, _write
from tests.stages.test_resize_rerun_reads import SMALL, _quarantine, _rows

FOOTER = 65536  # pyarrow reads a 64 KiB tail to find a footer


def _table(out: Path, src: Path) -> tuple:
    """v1's schema, rows and quarantine, the source's path written SRC (runs over copies of one source compared)."""
    st = Store(out)
    schema = (st.version_dir("images", 1) / "schema.json").read_text().replace(str(src), "SRC")
    rows = {k: (files, json.dumps(meta, sort_keys=True, default=str).replace(str(src), "SRC"))
            for k, (files, meta) in _rows(st).items()}
    return json.loads(schema), rows, repr(_quarantine(st)).replace(str(src), "SRC")


def test_a_first_run_reads_each_file_once_and_commits_the_content_lineage(tmp_path: Path, monkeypatch) -> None:
    src, out = _source(tmp_path), tmp_path / "store"
    files = sorted(src.glob("*.parquet"))
    cfg = load_config(None, SMALL)
    counts = _counting(monkeypatch, src)
    first = stage.run(cfg, src, out)
    assert first.written == 2 * ROWS and not first.quarantined
    for f in files:  # one pass and one footer read; before: hashed whole, its cells read again, three footers
        size = f.stat().st_size
        assert size <= counts[f.name] <= size + FOOTER, (f.name, counts[f.name], size)
    st = Store(out)
    note = read_note(st, "images", first.version, PARQUET_NOTE)
    assert note["tars"] == {str(f): [hashlib.sha256(f.read_bytes()).hexdigest(), ROWS] for f in files}

    # the lineage of the bytes: the next run is up to date and reads nothing (not a footer: which columns it holds,
    # for an unset resize.columns.mask, its version of this listing says)
    counts.clear()
    assert stage.run(cfg, src, out).up_to_date and not counts
    fresh = tmp_path / "fresh"  # a fresh store's run, the files cached now (hashed first): the same version
    stage.run(cfg, src, fresh)
    assert _table(out, src) == _table(fresh, src)
    counts.clear()
    again = stage.run(load_config(None, {**SMALL, "resize.val_fraction": 0.5}), src, out)
    assert again.reused == 2 * ROWS and again.written == 0
    for f in files:  # carried unread: its footer alone, once (the bar's total and the column check share it)
        assert counts[f.name] <= FOOTER, (f.name, counts[f.name])


def test_a_first_run_sigkilled_at_each_step_of_settling_resumes_its_version(tmp_path: Path) -> None:
    """A real SIGKILL after the read hashes were cached, after schema.json was rewritten, after the pending record
    went (three runs side by side, each its own source and store): each rerun resumes v1, renders nothing, ends as
    an uninterrupted run, and the next run is up to date."""
    steps = ["listing_cached", "listing_rewritten", "listing_settled"]
    run = ("import sys; from pipeline.config import load_config; from stages.resize.stage import run;"
           f"run(load_config(None, {SMALL!r}), sys.argv[1], sys.argv[2])")
    killed, made = [], _source(tmp_path)
    for at in steps:
        src = shutil.copytree(made, tmp_path / at / "src")  # new inodes: not in the file-hash cache
        killed.append(subprocess.Popen([sys.executable, "-c", run, str(src), str(tmp_path / at / "store")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                       env={**os.environ, "STORE_CRASH_AT": at}))
    fresh = tmp_path / "fresh"
    stage.run(load_config(None, SMALL), made, fresh)
    want = _table(fresh, made)
    cfg = load_config(None, SMALL)
    for at, proc in zip(steps, killed):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == -9, (at, err[-2000:])
        src, out = tmp_path / at / "src", tmp_path / at / "store"
        again = stage.run(cfg, src, out)
        assert (again.version, again.resumed, again.written) == (1, 2 * ROWS, 0), at
        assert not (Store(out).version_dir("images", 1) / first_read.PENDING_JSON).exists()
        assert stage.run(cfg, src, out).up_to_date, at
        assert _table(out, src) == want, at


def test_a_file_changed_while_read_is_read_again_by_the_next_run(tmp_path: Path, monkeypatch) -> None:
    """part-0 is rewritten (other images) once its rows were read: the version holds the rows read then, so it must
    not commit under the new bytes' lineage (the next run would call it up to date, the old images kept)."""
    src, out = _source(tmp_path), tmp_path / "store"
    cfg = load_config(None, SMALL)
    victim = src / "part-0.parquet"
    real, changed = parquet_source._file_samples, []

    def samples(path, *a, **k):
        yield from real(path, *a, **k)
        if Path(path) == victim and not changed:
            changed.append(path)
            _write(victim, seed=5)
    with monkeypatch.context() as m:
        m.setattr(parquet_source, "_file_samples", samples)
        first = stage.run(cfg, src, out)
    assert first.written == 2 * ROWS and changed
    assert str(victim) not in read_note(Store(out), "images", 1, PARQUET_NOTE)["tars"]
    again = stage.run(cfg, src, out)
    assert not again.up_to_date, "the table holds part-0's old images, the run calls it up to date"
    assert (again.written, again.reused) == (ROWS, ROWS)  # part-0's new rows; part-1 carried
    assert stage.run(cfg, src, out).up_to_date


def test_a_row_group_over_the_kept_bytes_is_read_right(tmp_path: Path) -> None:
    """pyarrow reads a row group's columns side by side; bytes of it dropped from memory (a row group over KEEP)
    are read again from the file: the rows are right, the hash is the whole file's."""
    from schemas.config import ParquetColumns
    from stages.resize.hashed_parquet import HashedParquet

    path = tmp_path / "x.parquet"
    _write(path, seed=3)
    lay = parquet_source._layout(pq.read_schema(path), ParquetColumns(), path)
    want = [s.target for s in parquet_source._file_samples(path, {path: lay}, 1 << 30)]
    size = path.stat().st_size
    for keep in (1 << 30, 1 << 16):  # a row group kept whole / far over what is kept
        stream = HashedParquet(path, keep=keep)
        with stream:
            got = [s.target for s in parquet_source._file_samples(path, {path: lay}, 1 << 30, stream)]
            stream.finish()
        assert got == want and stream.digest() == hashlib.sha256(path.read_bytes()).hexdigest(), keep
