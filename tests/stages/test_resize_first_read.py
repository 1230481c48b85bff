"""A first resize-bucket run over a webdataset source reads each local tar once (stages/resize/first_read.py): its
sha256, for the listing hash and the source-tars note, is taken from the bytes the reader streams (before: one
pass to hash each tar, then one to stream it). The version commits under the same lineage a hash-first run gives
(the next run is up to date, nothing read); a run killed before its commit records nothing (no cached hash, no
note) and its rerun resumes the version."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from models.file_hashes import FileHashes
from pipeline.config import load_config
from stages.resize import stage
from stages.resize.known_tars import NOTE
from store import Store
from store.version_notes import read_note
from tests.stages.read_counter import count_reads_under
from tests.stages.test_resize_rerun_reads import SMALL, _quarantine, _rows


def changed_once_streamed(monkeypatch, victim: Path, change) -> list[Path]:
    """`change(victim)` runs once, right after the first tar's stream is read whole (closed); returns the list that
    records it (empty while it has not run). 1 KiB of zeros appended keeps a tar valid."""
    from stages.resize import first_read

    real, changed = first_read.HashingStream.close, []

    def close(self):
        real(self)
        if not changed:
            changed.append(victim)
            change(victim)
    monkeypatch.setattr(first_read.HashingStream, "close", close)
    return changed


def _png(rng: np.random.Generator, side: int) -> bytes:
    """Noise: a PNG about as large as its pixels (a tar's bytes are its images, not its headers)."""
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _source(tmp_path: Path, tars: int = 4, per_tar: int = 3) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for t in range(tars):
        with tarfile.open(src / f"shard-{t:04d}.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
            for i in range(per_tar):
                for name, data in ((f"s{t}_{i}.png", _png(rng, 256)), (f"s{t}_{i}.control.png", _png(rng, 224)),
                                   (f"s{t}_{i}.txt", f"edit {t} {i}".encode())):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(data), 0, 0o644
                    tf.addfile(info, io.BytesIO(data))
    return src


def _counting(monkeypatch, src: Path):
    """{tar name: bytes read} through Python's open, webdataset's gopen and tarfile's own open (the header walk)."""
    counts = count_reads_under(monkeypatch, src)
    import builtins

    monkeypatch.setattr(tarfile, "bltn_open", builtins.open)  # tarfile kept the real open at import
    return counts


def test_a_first_run_reads_each_tar_once_and_commits_the_content_lineage(tmp_path: Path, monkeypatch) -> None:
    src, out = _source(tmp_path), tmp_path / "store"
    cfg = load_config(None, SMALL)
    counts = _counting(monkeypatch, src)
    first = stage.run(cfg, src, out)
    assert first.written == 12 and not first.quarantined
    for tar in sorted(src.glob("*.tar")):
        size = tar.stat().st_size
        # streamed once (+ the bar's header walk, a buffer per member); before: hashed whole, then streamed (2x)
        assert size <= counts[tar.name] < 1.3 * size, (tar.name, counts[tar.name], size)

    st = Store(out)
    version = st.newest_complete("images")[0]
    note = read_note(st, "images", version, NOTE)
    assert note["tars"] == {str(t): [hashlib.sha256(t.read_bytes()).hexdigest(), 3] for t in sorted(src.glob("*.tar"))}
    # the lineage of the bytes, as a hash-first run has it: the next run is up to date and reads nothing
    assert st.tables()["images"] == version
    counts.clear()
    again = stage.run(cfg, src, out)
    assert again.up_to_date and again.version == version and not counts
    # and the same as a fresh store's run, whose tars are cached now (hashed first)
    fresh = tmp_path / "fresh"
    stage.run(cfg, src, fresh)
    schema = [(Store(o).version_dir("images", 1) / "schema.json").read_text() for o in (out, fresh)]
    assert schema[0] == schema[1]
    assert _rows(Store(fresh)) == _rows(st) and _quarantine(Store(fresh)) == _quarantine(st)


class Killed(BaseException):
    pass


@pytest.mark.parametrize("where", ["before the lineage is settled", "after schema.json is rewritten"])
def test_a_run_killed_before_its_commit_records_nothing_and_resumes(tmp_path: Path, monkeypatch, where) -> None:
    src, out = _source(tmp_path), tmp_path / "store"
    cfg = load_config(None, SMALL)
    tars = sorted(src.glob("*.tar"))
    with monkeypatch.context() as m:
        if where == "before the lineage is settled":
            def settle(*a, **k):
                raise Killed
            m.setattr(stage, "settle_listing", settle)
        else:
            def commit(*a, **k):
                raise Killed
            m.setattr(stage, "commit_version", commit)
        with pytest.raises(Killed):
            stage.run(cfg, src, out)
    st = Store(out)
    assert st.newest_complete("images") is None
    with FileHashes() as hashes:
        cached = [hashes.cached(t) for t in tars]
    # the streamed hashes are cached only with the lineage settled, just before the commit
    assert cached == ([None] * 4 if where == "before the lineage is settled" else
                      [hashlib.sha256(t.read_bytes()).hexdigest() for t in tars])

    counts = _counting(monkeypatch, src)
    again = stage.run(cfg, src, out)
    assert again.resumed == 12 and again.written == 0 and again.version == 1
    for tar in tars:  # the resume streams each tar once (its finished samples passed over), never hashes it first
        assert counts[tar.name] < 1.3 * tar.stat().st_size
    note = read_note(st, "images", 1, NOTE)
    assert note["tars"] == {str(t): [hashlib.sha256(t.read_bytes()).hexdigest(), 3] for t in tars}
    assert stage.run(cfg, src, out).up_to_date


def test_a_tar_changed_while_streamed_is_not_cached_nor_noted(tmp_path: Path, monkeypatch) -> None:
    """Its bytes are not known: it stands in the lineage for a stand-in no run computes (not read again) and is not
    noted, so the next run streams it again (tests/stages/test_resize_first_read_review.py)."""
    src, out = _source(tmp_path, tars=2), tmp_path / "store"
    cfg = load_config(None, SMALL)
    victim = src / "shard-0000.tar"

    def grow(tar: Path) -> None:
        with open(tar, "ab") as f:
            f.write(b"\0" * 1024)
    changed = changed_once_streamed(monkeypatch, victim, grow)
    run = stage.run(cfg, src, out)
    assert run.written == 6 and changed
    note = read_note(Store(out), "images", run.version, NOTE)
    assert set(note["tars"]) == {str(src / "shard-0001.tar")}  # the next run streams shard-0000 again
