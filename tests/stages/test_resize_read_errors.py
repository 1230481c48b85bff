"""A local read error (EIO: a failing disk; EACCES) is not bad data (stages/resize/webdataset_source.py
`_unread_rest`, sources.py `read_source_file`): every sample it kept from being read is a `read-error` quarantine
row naming the file and the OS error (before: a tar's current sample was "truncated or corrupt" and the rest of the
tar silently missing), the version does not count the file as read (first_read.settle_listing's stand-in line), and
a rerun once the disk reads again adds exactly those samples, the others carried, not rendered again: the store then
equals a clean run's. The fault is raised at a chosen byte by the stream the reader reads (the tar shard's, a source
file's)."""

from __future__ import annotations

import errno
import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from models.file_hashes import FileHashes
from pipeline.config import load_config
from stages.resize import rendering, sources, stage, webdataset_source
from stages.resize.content import content_listing_hash
from store import Store
from tests.stages.test_resize_rerun_reads import SMALL, _quarantine, _rows


def _png(i: int, side: int = 64) -> bytes:
    """Noise, ~12 KB: a member spans more than one of tarfile's 10 KiB stream reads, so a fault in one sample's
    data surfaces there, not in the read of an earlier one's."""
    buf = io.BytesIO()
    pixels = np.random.default_rng(i).integers(0, 256, (side, side + i, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _tars(src: Path, tars: int = 2, per_tar: int = 3) -> None:
    src.mkdir(exist_ok=True)
    for t in range(tars):
        with tarfile.open(src / f"shard-{t}.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
            for i in range(per_tar):
                for name, data in ((f"s{t}_{i}.png", _png(3 * t + i)), (f"s{t}_{i}.control.png", _png(9 + i)),
                                   (f"s{t}_{i}.txt", f"edit {t} {i}".encode())):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(data), 0, 0o644
                    tf.addfile(info, io.BytesIO(data))


class _Failing(io.RawIOBase):
    """A file whose reads end with EIO once they reach byte `at` (later reads fail too: a bad sector)."""

    def __init__(self, raw, at: int) -> None:
        self.raw, self.at = raw, at

    def readinto(self, b) -> int:
        pos = self.raw.tell()
        if pos + len(b) > self.at:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return self.raw.readinto(b)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.raw.close()
        super().close()


def _failing_tar(monkeypatch, victim: Path, at: int) -> None:
    """The reader's stream of `victim` fails at byte `at` (the header walk, tarfile's own open, reads it fine)."""
    real = webdataset_source.open_shard

    def opened(url: str):
        f = real(url)
        return io.BufferedReader(_Failing(f, at)) if Path(url) == victim else f
    monkeypatch.setattr(webdataset_source, "open_shard", opened)


def _data_offset(tar: Path, member: str) -> int:
    with tarfile.open(tar) as tf:
        return tf.getmember(member).offset_data


@pytest.mark.parametrize("hashed_first", [False, True], ids=["first-read", "hashed-first"])
def test_a_tar_read_error_quarantines_each_unread_sample_and_a_rerun_adds_them(tmp_path, monkeypatch,
                                                                                hashed_first) -> None:
    src, out, clean = tmp_path / "src", tmp_path / "store", tmp_path / "clean"
    _tars(src)
    victim = src / "shard-1.tar"
    if hashed_first:  # the tars in the hash cache: the listing is the real one, no tar streamed for its hash
        with FileHashes() as h:
            for t in sorted(src.glob("*.tar")):
                h.sha256(t)
    cfg = load_config(None, SMALL)
    with monkeypatch.context() as m:
        _failing_tar(m, victim, _data_offset(victim, "s1_1.control.png") + 10)
        first = stage.run(cfg, src, out)
    assert first.written == 4 and dict(first.quarantined) == {"read-error": 2}
    q = {r["source"]: r for r in Store(out).quarantine().to_pylist()}
    assert sorted(q) == [f"{victim}:s1_1", f"{victim}:s1_2"]  # the cut sample and the one after it, both named
    assert all(str(victim) in r["detail"] and "Input/output error" in r["detail"] for r in q.values())
    assert "could not read 2 sample(s)" in str(first) and "rerun" in str(first)

    rendered = []
    real_render = rendering.render
    monkeypatch.setattr(rendering, "render", lambda rec, *a, **k: rendered.append(rec.source) or real_render(rec, *a, **k))
    again = stage.run(cfg, src, out)  # the disk reads again
    assert not again.up_to_date and again.version == first.version + 1
    assert again.written == 2 and again.reused == 4 and not again.quarantined
    assert sorted(rendered) == [f"{victim}:s1_1", f"{victim}:s1_2"]  # the good samples carried, not rendered
    assert stage.run(cfg, src, out).up_to_date

    stage.run(cfg, src, clean)
    assert _rows(Store(out)) == _rows(Store(clean))
    schemas = [json.loads((Store(o).version_dir("images", v) / "schema.json").read_text())
               for o, v in ((out, again.version), (clean, 1))]
    assert schemas[0]["lineage"] == schemas[1]["lineage"]  # the lineage of the source read whole


def test_a_tar_whose_headers_fail_too_has_one_row_for_its_rest(tmp_path, monkeypatch) -> None:
    """When the header walk past the failure fails as well, the rest of the tar is one row, not silence."""
    src, out = tmp_path / "src", tmp_path / "store"
    _tars(src, tars=1)
    victim = src / "shard-0.tar"
    at = _data_offset(victim, "s0_1.control.png") + 10
    _failing_tar(monkeypatch, victim, at)
    real_open = tarfile.open

    def walk(name=None, mode="r", *a, **k):  # the seeking header walk (the bar's count, `_unread_rest`) fails too
        if name is not None and Path(name) == victim and mode == "r:":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_open(name, mode, *a, **k)
    monkeypatch.setattr(tarfile, "open", walk)
    s = stage.run(load_config(None, SMALL), src, out)
    rows = {r["source"]: r for r in Store(out).quarantine().to_pylist()}
    assert s.written == 1 and sorted(rows) == [str(victim), f"{victim}:s0_1"]
    assert {r["reason"] for r in rows.values()} == {"read-error"}
    assert "the rest of the tar after key 's0_1'" in rows[str(victim)]["detail"]


def _folder(src: Path) -> None:
    for i in range(3):
        for d, data in (("target", _png(i)), ("control", _png(5 + i))):
            (src / d).mkdir(parents=True, exist_ok=True)
            (src / d / f"s{i}.png").write_bytes(data)
        (src / "target" / f"s{i}.txt").write_text(f"edit {i}")


def _jsonl(src: Path) -> None:
    src.mkdir()
    lines = []
    for i in range(3):
        (src / f"t{i}.png").write_bytes(_png(i))
        (src / f"c{i}.png").write_bytes(_png(5 + i))
        lines.append(json.dumps({"target": f"t{i}.png", "controls": [f"c{i}.png"], "caption": f"edit {i}"}))
    (src / "data.jsonl").write_text("\n".join(lines) + "\n")


class _FaultyOs:
    """`os` as sources.py sees it, its `fdopen` of `victim` giving a file that fails at byte `at`."""

    def __init__(self, victim: Path, at: int) -> None:
        self.victim, self.at = victim, at

    def __getattr__(self, name):
        return getattr(os, name)

    def fdopen(self, fd, mode="r", *a, **k):
        f = os.fdopen(fd, mode, *a, **k)
        if os.readlink(f"/proc/self/fd/{fd}") == str(self.victim):
            return io.BufferedReader(_Failing(f, self.at))
        return f


@pytest.mark.parametrize("fmt", ["folder", "jsonl"])
def test_a_file_read_error_is_a_read_error_row_and_a_rerun_reads_it(tmp_path, monkeypatch, fmt) -> None:
    src, out, clean = tmp_path / "src", tmp_path / "store", tmp_path / "clean"
    (_folder if fmt == "folder" else _jsonl)(src)
    victim = (src / "control" / "s1.png") if fmt == "folder" else (src / "c1.png")
    cfg = load_config(None, SMALL)
    with monkeypatch.context() as m:  # the listing hash (before) read it fine: the reader's read fails
        m.setattr(sources, "os", _FaultyOs(victim, 100))
        first = stage.run(cfg, src, out)
    [q] = Store(out).quarantine().to_pylist()
    assert first.written == 2 and q["reason"] == "read-error"
    assert str(victim) in q["detail"] and "Input/output error" in q["detail"]
    assert "could not read 1 sample(s)" in str(first)

    again = stage.run(cfg, src, out)
    assert not again.up_to_date and again.written == 1 and again.reused == 2 and not again.quarantined
    assert stage.run(cfg, src, out).up_to_date
    stage.run(cfg, src, clean)
    assert _rows(Store(out)) == _rows(Store(clean))
    assert _quarantine(Store(clean)) == []


def test_the_new_version_line_names_no_provisional_listing(tmp_path, capsys) -> None:
    """A tar added to a source is hashed as it is read (first_read.py): the listing hash before the run is a
    provisional one the version never has; the "why new" line says so instead of printing it."""
    src, out = tmp_path / "src", tmp_path / "store"
    _tars(src, tars=1)
    cfg = load_config(None, SMALL)
    stage.run(cfg, src, out)
    _tars(tmp_path / "more", tars=2)
    (tmp_path / "more" / "shard-1.tar").rename(src / "shard-1.tar")
    provisional = content_listing_hash(src.resolve(), frozenset({str(src.resolve() / "shard-1.tar")}))
    capsys.readouterr()
    second = stage.run(cfg, src, out)
    said = capsys.readouterr()
    line = next(ln for ln in (said.out + said.err).splitlines() if "is not this run's" in ln)
    assert second.written == 3 and provisional not in line
    assert "hashed as its 1 file(s) new to this store are read" in line


def test_store_repair_stops_on_a_read_error_and_repairs_once_it_reads(tmp_path, monkeypatch) -> None:
    """A repair commits under the damaged version's own lineage, which says every file was read: with a sample a
    read error kept out it would pass for whole. It stops with one line; once the file reads, it repairs."""
    import yaml
    from typer.testing import CliRunner

    from damage import HEADER, flip_bit, key_at, sample_byte
    from pipeline.cli import app

    src, store, config = tmp_path / "src", tmp_path / "store", tmp_path / "config.yaml"
    _folder(src)
    config.write_text(yaml.safe_dump({"resize": {k.split(".", 1)[1]: v for k, v in SMALL.items()}}))
    stage.run(load_config(config), src, store)
    key = key_at(store, "images", 1)
    victim = Path(Store(store).reader("images").meta(key)["source"])
    flip_bit(*sample_byte(store, "images", key, HEADER, 3), 5)
    runner = CliRunner()
    with monkeypatch.context() as m:
        m.setattr(sources, "os", _FaultyOs(victim, 100))
        res = runner.invoke(app, ["store", "repair", str(store), "--config", str(config)])
    assert res.exit_code == 1 and "store repair: 1 source sample(s) could not be read" in res.output, res.output
    res = runner.invoke(app, ["store", "repair", str(store), "--config", str(config)])
    assert res.exit_code == 0, res.output
    assert len(Store(store).reader("images").keys()) == 3


class _Killed(BaseException):
    pass


@pytest.mark.parametrize("fmt", ["folder", "tars"])
def test_a_run_killed_after_its_read_error_lineage_was_written_resumes(tmp_path, monkeypatch, fmt) -> None:
    """A kill between the schema rewrite that marks the files a read error kept out and the commit: the rerun (the
    disk reads again) resumes that version, its rendered samples kept, rather than rendering everything anew."""
    from store import format as store_format

    src, out, clean = tmp_path / "src", tmp_path / "store", tmp_path / "clean"
    cfg = load_config(None, SMALL)
    real_crash = store_format.crash_point

    def crash(name: str) -> None:
        if name == "listing_rewritten":
            raise _Killed
        real_crash(name)
    with monkeypatch.context() as m:
        m.setattr(store_format, "crash_point", crash)
        if fmt == "folder":
            _folder(src)
            m.setattr(sources, "os", _FaultyOs(src / "control" / "s1.png", 100))
        else:  # first read: the tars hashed as streamed, the failed one not
            _tars(src)
            victim = src / "shard-1.tar"
            _failing_tar(m, victim, _data_offset(victim, "s1_1.control.png") + 10)
        with pytest.raises(_Killed):
            stage.run(cfg, src, out)
    again = stage.run(cfg, src, out)
    good = 2 if fmt == "folder" else 4
    assert (again.version, again.resumed, again.written) == (1, good, 1 if fmt == "folder" else 2)
    assert not (Store(out).version_dir("images", 1) / ".read-errors.json").exists()
    assert stage.run(cfg, src, out).up_to_date
    stage.run(cfg, src, clean)
    assert _rows(Store(out)) == _rows(Store(clean))


@pytest.mark.parametrize("fmt", ["tars", "folder"])
def test_a_rerun_whose_unread_files_still_fail_alike_writes_no_new_version(tmp_path, monkeypatch, capsys,
                                                                          fmt) -> None:
    """Rerun while the same files still fail the same way, nothing else changed: the version is kept (current, no
    new version for the encoders and train to see as new input, no in-progress folder left), one line says how
    many samples in which files are still unreadable. A failure that now keeps fewer samples out is another
    version (more rows); once the disk reads, the rerun adds the rest."""
    from store import format as store_format

    src, out = tmp_path / "src", tmp_path / "store"
    cfg = load_config(None, SMALL)

    def failing(m, later: bool = False) -> Path:
        if fmt == "folder":
            victim = src / "control" / "s1.png"
            m.setattr(sources, "os", _FaultyOs(victim, 100))
            return victim
        victim = src / "shard-1.tar"
        _failing_tar(m, victim, _data_offset(victim, "s1_2.control.png" if later else "s1_1.control.png") + 10)
        return victim
    (_folder if fmt == "folder" else _tars)(src)
    with monkeypatch.context() as m:
        victim = failing(m)
        first = stage.run(cfg, src, out)
        capsys.readouterr()
        again = stage.run(cfg, src, out)
    printed = capsys.readouterr().out
    assert "reading those files again" in printed and "writing a new version" not in printed, printed
    unread = 1 if fmt == "folder" else 2
    assert (again.up_to_date, again.version, again.written) == (True, first.version, 0)
    assert store_format.list_versions(out, "images") == [first.version]  # nothing new, nothing left in progress
    assert Store(out).tables()["images"] == first.version
    said = str(again)
    assert f"{unread} sample(s) in 1 file(s) still unreadable" in said and str(victim) in said, said
    assert "no new version" in said and "rerun once" in said, said
    assert again.to_json()["up_to_date"] and again.quarantined["read-error"] == unread
    assert len(Store(out).quarantine()) == unread  # its rows not repeated

    if fmt == "tars":  # the failure moved: one sample fewer kept out, the same lineage, so another version
        with monkeypatch.context() as m:
            failing(m, later=True)
            moved = stage.run(cfg, src, out)
        assert not moved.up_to_date and moved.version == first.version + 1 and moved.written == 1
    done = stage.run(cfg, src, out)  # the disk reads again: the rest added
    assert not done.up_to_date and done.written == 1 and not done.quarantined
    assert stage.run(cfg, src, out).up_to_date


@pytest.mark.parametrize("fmt", ["tars", "parquet"])
def test_a_run_sigkilled_after_its_quarantine_rows_resumes_with_one_runs_rows(tmp_path, monkeypatch, fmt) -> None:
    """A real SIGKILL at the commit's shard commit, after the read-error rows were written (the one shard holds
    every sample), resumed while the disk still fails: the store ends with exactly the rows and quarantine an
    uninterrupted run gives, one row per unread sample (range), none written twice."""
    import subprocess
    import sys

    from failing_disk_run import failing_disk
    from tests.stages.test_resize_rerun_parquet import _source

    src, out, clean = tmp_path / "src", tmp_path / "store", tmp_path / "clean"
    _tars(src) if fmt == "tars" else _source(tmp_path)
    cmd = [sys.executable, str(Path(__file__).with_name("failing_disk_run.py")), fmt, str(src), str(out)]
    killed = subprocess.run(cmd, env={**os.environ, "STORE_CRASH_AT": "after_shard_commit"}, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    def quarantine(o: Path) -> list[tuple]:  # every row, twice if written twice (`_quarantine` is a set)
        return sorted((r["source"], r["reason"], r["detail"]) for r in Store(o).quarantine().to_pylist())
    written = quarantine(out)
    assert written and not Store(out).tables()  # killed after its quarantine rows, before the commit
    done = subprocess.run(cmd, env=os.environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "kept from an interrupted run" in done.stdout, done.stderr[-2000:]
    failing_disk(monkeypatch, fmt, src)
    stage.run(load_config(None, SMALL), src, clean)
    assert quarantine(out) == quarantine(clean) == written
    assert _rows(Store(out)) == _rows(Store(clean))


def _white_mask() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((64, 64), 255, np.uint8), "L").save(buf, format="PNG")
    return buf.getvalue()


def _duplicated_across_tars(src: Path) -> None:
    """shard-0: s0_0, s0_1, s0_2 (large: a fault in it leaves s0_1 read); shard-1: s1_0, the content of s0_1 with a
    mask, and s1_1."""
    src.mkdir()
    same = (_png(50), _png(51), b"the same edit")  # s0_1 (shard-0) and s1_0 (shard-1): one content key
    members = {0: [("s0_0", (_png(1), _png(2), b"edit a"), None), ("s0_1", same, None),
                   ("s0_2", (_png(3, side=256), _png(4, side=256), b"edit c"), None)],
               1: [("s1_0", same, _white_mask()), ("s1_1", (_png(5), _png(6), b"edit d"), None)]}
    for t, samples in members.items():
        with tarfile.open(src / f"shard-{t}.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
            for stem, (target, control, caption), mask in samples:
                parts = [(f"{stem}.png", target), (f"{stem}.control.png", control), (f"{stem}.txt", caption)]
                parts += [(f"{stem}.mask.png", mask)] if mask else []
                for name, data in parts:
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(data), 0, 0o644
                    tf.addfile(info, io.BytesIO(data))


def _copies(o: Path) -> dict:
    with Store(o).reader("images") as r:
        return {k: (r.meta(k)["source"].rsplit("/", 1)[-1], r.meta(k)["has_mask"]) for k in r.keys()}


def test_a_rerun_whose_fault_moved_keeps_no_version_holding_another_copy_of_a_key(tmp_path, monkeypatch) -> None:
    """The failure moved within the unread file: the first copy of a duplicated content is read now, so the run's
    row of that key is that copy (its source, no mask), not the later copy (with a mask) the version holds. The key
    sets are equal; the rows are not: a new version, as a run on an empty store gives (before: that version kept)."""
    src, out, fresh = tmp_path / "src", tmp_path / "store", tmp_path / "fresh"
    _duplicated_across_tars(src)
    victim = src / "shard-0.tar"
    cfg = load_config(None, SMALL)
    with monkeypatch.context() as m:  # the disk fails in s0_1: s0_1, s0_2 unread, s1_0 holds the content
        _failing_tar(m, victim, _data_offset(victim, "s0_1.control.png") + 10)
        first = stage.run(cfg, src, out)
    with monkeypatch.context() as m:  # now it fails later, in s0_2: s0_1 is read, s1_0 its duplicate
        _failing_tar(m, victim, _data_offset(victim, "s0_2.control.png") + 10)
        again = stage.run(cfg, src, out)
        stage.run(cfg, src, fresh)  # what a run with this fault gives
    assert not again.up_to_date and again.version == first.version + 1
    assert _copies(out) == _copies(fresh)
    assert _rows(Store(out)) == _rows(Store(fresh))


def test_a_source_whose_only_tar_fails_keeps_its_version_from_the_first_rerun(tmp_path, monkeypatch) -> None:
    """One tar, failing: the first run streams it for its hash (nothing known yet), the rerun hashes it up front
    (the version's note names none of the source's tars). Its listing line is not its digest but "left unread",
    so the rerun keeps the version (before: one more version with the same rows, then kept). The tar changed
    where it was read (a mask added to the sample before the failure), still failing: a new version."""
    from store import format as store_format

    src, out = tmp_path / "src", tmp_path / "store"
    _tars(src, tars=1)
    victim = src / "shard-0.tar"
    cfg = load_config(None, SMALL)
    with monkeypatch.context() as m:
        _failing_tar(m, victim, _data_offset(victim, "s0_1.control.png") + 10)
        first = stage.run(cfg, src, out)
        again = stage.run(cfg, src, out)
    assert (first.written, again.up_to_date, again.version) == (1, True, first.version)
    assert store_format.list_versions(out, "images") == [first.version]

    with tarfile.open(victim) as tf:  # the same tar with a mask for s0_0, read before the failure
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    with tarfile.open(victim, "w", format=tarfile.USTAR_FORMAT) as tf:
        for info, data in members[:3] + [(tarfile.TarInfo("s0_0.mask.png"), _white_mask())] + members[3:]:
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tf.addfile(info, io.BytesIO(data))
    with monkeypatch.context() as m:
        _failing_tar(m, victim, _data_offset(victim, "s0_1.control.png") + 10)
        masked = stage.run(cfg, src, out)
    assert not masked.up_to_date and masked.version == first.version + 1
    with Store(out).reader("images") as r:
        assert [r.meta(k)["has_mask"] for k in r.keys()] == [True]
