"""Review reproductions for stages/resize/first_read.py: a local tar read for the first time is hashed from the
bytes the reader streams, and the version's lineage settled just before its commit."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.config import load_config
from stages.resize import first_read, stage
from store import Store
from tests.stages.test_resize_first_read import _source, changed_once_streamed
from tests.stages.test_resize_rerun_reads import SMALL
import warm_start


def _rewrite(tar: Path, seed: int) -> None:
    """The same members (names, sizes differ) with other pixels: other samples."""
    rng = np.random.default_rng(seed)
    members = []
    with tarfile.open(tar) as tf:
        for m in tf.getmembers():
            data = tf.extractfile(m).read()
            if m.name.endswith(".png"):
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
                data = buf.getvalue()
            members.append((m.name, data))
    with tarfile.open(tar, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tf.addfile(info, io.BytesIO(data))


def test_a_tar_rewritten_while_streamed_is_rendered_on_the_next_run(tmp_path: Path, monkeypatch) -> None:
    """The version holds the bytes streamed before the rewrite: it must not commit under the rewritten tar's
    lineage, or the next run calls it up to date and the new samples are never rendered."""
    src, out = _source(tmp_path, tars=2), tmp_path / "store"
    cfg = load_config(None, SMALL)
    victim = src / "shard-0000.tar"
    with monkeypatch.context() as m:  # the first tar, once streamed: rewritten with other images
        changed = changed_once_streamed(m, victim, lambda tar: _rewrite(tar, 7))
        first = stage.run(cfg, src, out)
    assert first.written == 6 and changed
    again = stage.run(cfg, src, out)
    assert not again.up_to_date, "the table holds the old images of shard-0000, the run calls it up to date"
    assert again.written == 3  # the rewritten tar's samples, the other tar's carried


class Killed(BaseException):
    pass


def test_a_run_killed_between_the_cache_write_and_the_schema_rewrite_resumes(tmp_path: Path, monkeypatch) -> None:
    """The streamed hashes are in the cache, the version's schema.json still the provisional one: the rerun
    (tars cached: the final listing) must resume that version, not render everything into a new one."""
    from store import format as store_format

    src, out = _source(tmp_path), tmp_path / "store"
    cfg = load_config(None, SMALL)
    real = store_format.atomic_write_json

    def write(path, value, *a, **k):
        if Path(path).name == "schema.json" and Path(path).exists():  # the rewrite, not the version's creation
            raise Killed
        return real(path, value, *a, **k)
    with monkeypatch.context() as m:
        m.setattr(store_format, "atomic_write_json", write)
        with pytest.raises(Killed):
            stage.run(cfg, src, out)
    assert Store(out).newest_complete("images") is None
    again = stage.run(cfg, src, out)
    assert (again.version, again.resumed, again.written) == (1, 12, 0)
    assert stage.run(cfg, src, out).up_to_date


def test_a_known_tar_rewritten_after_it_was_streamed_is_rendered_on_the_next_run(tmp_path: Path, monkeypatch) -> None:
    """shard-0000 is in the hash cache (hashed first, streamed as ever), shard-0001 read for the first time. The
    first is rewritten once streamed: the lineage settled at the commit keeps the hash it had at the start."""
    from models.file_hashes import FileHashes

    src, out = _source(tmp_path, tars=2), tmp_path / "store"
    cfg = load_config(None, SMALL)
    known = src / "shard-0000.tar"
    with FileHashes() as hashes:
        hashes.sha256(known)
    real, changed = first_read.HashingStream.__init__, []

    def opened(self, raw):  # shard-0001's stream opens once shard-0000 was streamed whole
        if not changed:
            changed.append(known)
            _rewrite(known, 11)
        real(self, raw)
    with monkeypatch.context() as m:
        m.setattr(first_read.HashingStream, "__init__", opened)
        first = stage.run(cfg, src, out)
    assert first.written == 6 and changed
    again = stage.run(cfg, src, out)
    assert not again.up_to_date, "the table holds the old images of shard-0000, the run calls it up to date"
    assert again.written == 3


def test_a_fresh_machine_rerunning_an_older_versions_settings_adopts_it_from_the_url(
        s3_env, tmp_path: Path, monkeypatch) -> None:
    """Settings A -> v1, B -> v2 (current) on a store URL; A again on another machine (an empty store cache, an
    empty file-hash cache; notes are not copied to a URL): the tars are not known there, but v1 may hold them,
    so they are hashed first and v1 is found on the remote. Read while streamed instead, the provisional listing
    matched no version and every image was rendered again into v3."""
    import json

    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.demo_data import make_demo_data

    data = tmp_path / "data"
    make_demo_data(data, n=6, fmt="webdataset", max_controls=1, seed=3)
    url = s3_env.url("wds-fresh")

    def run(area: str, cache: str) -> dict:
        res = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(data), "--area", area, "--multiple",
                                       "32", "--val-fraction", "0.25", "--workers", "0", "--json", "--store", url,
                                       "--cache-dir", str(tmp_path / cache)])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    assert run("4096", "node-a")["version"] == 1 and run("9216", "node-b")["version"] == 2
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "another-machine"))  # its own file-hash cache
    again = run("4096", "node-c")
    assert (again["version"], again["up_to_date"], again["encoded"]) == (1, True, 0)


def test_a_source_copied_to_another_disk_is_up_to_date(tmp_path: Path) -> None:
    """Copied tars (new inodes: not in the file-hash cache) at a path no note names: hashed first, the listing
    (relative names and bytes) is v1's, so v1 is up to date, as for a folder source; read while streamed, a
    duplicate v2 was written (and every table built on it after)."""
    import shutil

    src, out = _source(tmp_path, tars=2), tmp_path / "store"
    cfg = load_config(None, SMALL)
    first = stage.run(cfg, src, out)
    copy = tmp_path / "disk2" / "src"
    shutil.copytree(src, copy)
    again = stage.run(cfg, copy, out)
    assert (again.up_to_date, again.version) == (True, first.version)


@pytest.mark.parametrize("at", ["after_shard_commit", "listing_cached", "listing_rewritten", "listing_settled"])
def test_a_first_run_sigkilled_at_each_step_of_settling_resumes_its_version(tmp_path: Path, at: str) -> None:
    """A real SIGKILL (no cleanup: the hash cache as far as it was written) mid-stream, after the streamed hashes
    were cached, after schema.json was rewritten, after the pending record went: the rerun resumes v1, renders
    nothing finished, ends as an uninterrupted run (rows, schema) and the next run is up to date."""
    import json
    import os
    import sys

    from tests.stages.test_resize_rerun_reads import _rows

    src, out = _source(tmp_path), tmp_path / "store"
    run = ("import sys; from pipeline.config import load_config; from stages.resize.stage import run;"
           f"run(load_config(None, {SMALL!r}), sys.argv[1], sys.argv[2])")
    done = warm_start.run([sys.executable, "-c", run, str(src), str(out)],  # started warm (tests/warm_start.py)
                          env={**os.environ, "STORE_CRASH_AT": at})
    assert done.returncode == -9, done.stderr[-2000:]
    cfg = load_config(None, SMALL)
    again = stage.run(cfg, src, out)
    assert again.version == 1 and again.resumed + again.written == 12 and again.resumed > 0
    vdir = Store(out).version_dir("images", 1)
    assert not (vdir / first_read.PENDING_JSON).exists()
    assert stage.run(cfg, src, out).up_to_date
    fresh = tmp_path / "fresh"
    stage.run(cfg, src, fresh)
    assert json.loads((vdir / "schema.json").read_text()) == \
        json.loads((Store(fresh).version_dir("images", 1) / "schema.json").read_text())
    assert _rows(Store(out)) == _rows(Store(fresh))


def test_a_run_killed_with_part_of_the_hashes_cached_resumes(tmp_path: Path, monkeypatch) -> None:
    """The cache is written in batches: a kill may leave some streamed tars cached and others not. The rerun's
    listing is then neither the provisional nor the final one; the version's record of pending tars finds it."""
    from models.file_hashes import FileHashes
    from store import format as store_format

    src, out = _source(tmp_path), tmp_path / "store"
    cfg = load_config(None, SMALL)
    real_write, real_learn = store_format.atomic_write_json, FileHashes.learn

    def write(path, value, *a, **k):
        if Path(path).name == "schema.json" and Path(path).exists():
            raise Killed
        return real_write(path, value, *a, **k)

    def learn(self, f, digest, before, read_at=None):  # only the first tar's row reached the database
        return Path(f).name == "shard-0000.tar" and real_learn(self, f, digest, before, read_at)
    with monkeypatch.context() as m:
        m.setattr(store_format, "atomic_write_json", write)
        m.setattr(FileHashes, "learn", learn)
        with pytest.raises(Killed):
            stage.run(cfg, src, out)
    with FileHashes() as hashes:
        assert [hashes.cached(t) is not None for t in sorted(src.glob("*.tar"))] == [True, False, False, False]
    again = stage.run(cfg, src, out)
    assert (again.version, again.resumed, again.written) == (1, 12, 0)
    assert stage.run(cfg, src, out).up_to_date
