"""A resize-bucket killed after committing a shard resumes without reading or hashing the source bytes of the
samples already in its committed shards (stages/resize/resumed_sources.py): only the unfinished samples are read,
and the table equals an uninterrupted run's (same rows, same bytes, same quarantine)."""

from __future__ import annotations

import os
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.config import load_config
from pipeline.demo_data import make_demo_data
from stages.resize import folder_source, jsonl_source, judge, sources, stage
from store import Store
import warm_start  # the killed and rerun resizes: real processes, started warm

SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.max_controls": 2, "resize.shard_size_mb": 0.01}
KILLED = ("import sys; from pipeline.config import load_config; from stages.resize.stage import run;"
          f"run(load_config(None, {SMALL!r}), sys.argv[1], sys.argv[2])")


def _rows(st: Store) -> dict[str, tuple]:
    with st.reader("images") as r:
        return {k: (r.files(k), r.meta(k)) for k in r.keys()}


def _quarantine(st: Store) -> list[tuple]:
    q = st.quarantine()
    return sorted(zip(q.column("source").to_pylist(), q.column("reason").to_pylist())) if q is not None else []


@pytest.mark.parametrize("fmt", ["folder", "jsonl", "webdataset"])
def test_a_resumed_run_reads_and_hashes_only_the_unfinished_samples(tmp_path: Path, monkeypatch, fmt: str) -> None:
    make_demo_data(tmp_path / "src", n=16, fmt=fmt, max_controls=2, seed=2)
    src, out = tmp_path / "src", tmp_path / "store"
    killed = warm_start.run([sys.executable, "-c", KILLED, str(src), str(out)],
                           env={**os.environ, "STORE_CRASH_AT": "after_shard_commit"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    vdir = out / "images" / "v1"
    (index,) = vdir.glob("*.index.parquet")
    finished = pq.read_table(index, columns=["source"]).column("source").to_pylist()
    assert finished

    hashed: list[int] = []
    read, members = Counter(), Counter()
    real_key, real_read, real_extract = judge.sample_key, sources.read_source_file, tarfile.TarFile.extractfile
    monkeypatch.setattr(judge, "sample_key", lambda t, c, cap: hashed.append(1) or real_key(t, c, cap))
    for reader in (folder_source, jsonl_source):
        monkeypatch.setattr(reader, "read_source_file",  # (path, root, max_bytes, what): the targets read
                            lambda p, *a: read.update([str(p)] if a[2] == "target" else []) or real_read(p, *a))
    monkeypatch.setattr(tarfile.TarFile, "extractfile",
                        lambda self, m: members.update([m.name.split(".", 1)[0]]) or real_extract(self, m))
    resumed = stage.run(load_config(None, SMALL), src, out)
    assert resumed.resumed == len(finished) and resumed.written == 16 - len(finished)
    assert len(hashed) == 16 - len(finished)  # before: all 16 hashed again
    if fmt == "webdataset":
        assert not {s.rsplit(":", 1)[1] for s in finished} & set(members)  # their members not read
        assert len(members) == 16 - len(finished)
    else:
        assert sum(read.values()) == len(read) == 16 - len(finished)  # before: 16
        assert not {s.split(" (", 1)[1].rstrip(")") if fmt == "jsonl" else s for s in finished} & \
            {p if fmt == "folder" else os.path.relpath(p, src) for p in read}
    monkeypatch.undo()

    fresh = stage.run(load_config(None, SMALL), src, tmp_path / "fresh")
    assert fresh.written == 16
    a, b = Store(out), Store(tmp_path / "fresh")
    assert _rows(a) == _rows(b)  # same keys, same PNG bytes, same metadata (source, split, bucket ...)
    assert _quarantine(a) == _quarantine(b)


def test_the_resumed_map_answers_as_the_dict_it_replaced() -> None:
    """`ResumedSources` (sorted digests, not a dict of str): every source found with its key, one not written
    is not, a source listed in two indexes gives the later key (dict.update did), 0 and 1 entries work."""
    from stages.resize.resumed_sources import ResumedSources

    parts = [([f"/src/target/{i}.png" for i in range(300)], [f"{i:032x}" for i in range(300)]),
             (["/src/target/7.png", "d\u00e9j\u00e0 vu.png", "a.tar:x\\xe9"], ["k" * 32, "short", "8" * 32])]
    want: dict[str, str] = {}
    for sources_, keys in parts:
        want.update(zip(sources_, keys))
    done = ResumedSources(iter(parts))
    assert len(done) == len(want) == 302 and {s: done.get(s) for s in want} == want
    assert done.get("/src/target/300.png") is None and done.get("/src/target/7.PNG") is None
    assert len(ResumedSources([])) == 0 and ResumedSources([]).get("x") is None and not ResumedSources([])
    assert ResumedSources([(["only"], ["k1"])]).get("only") == "k1"


def test_the_summary_counts_the_whole_table_after_a_resume_or_a_carry_forward(tmp_path: Path, monkeypatch) -> None:
    """The summary's "controls per sample" and target buckets describe the version written, as its splits do: a
    resumed run counted only the samples rendered after the kill (and a carried-forward one left its samples'
    buckets out), so a table of 16 read "controls per sample: 0: 3, 1: 2" after a resume. The run that carries
    samples forward never parses a whole `images` manifest (every column: ~730 MB at 1M samples), neither to find
    the rows it carries (store/reuse.py) nor to count the version it wrote (`summary.version_counts`)."""
    make_demo_data(tmp_path / "src", n=16, fmt="folder", max_controls=2, seed=2)
    src, out = tmp_path / "src", tmp_path / "store"
    killed = warm_start.run([sys.executable, "-c", KILLED, str(src), str(out)],
                           env={**os.environ, "STORE_CRASH_AT": "after_shard_commit"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = stage.run(load_config(None, SMALL), src, out)
    fresh = stage.run(load_config(None, SMALL), src, tmp_path / "fresh")
    assert resumed.resumed > 0 and fresh.written == 16
    assert resumed.controls == fresh.controls and sum(fresh.controls.values()) == 16
    assert resumed.buckets == fresh.buckets and resumed.splits == fresh.splits

    make_demo_data(tmp_path / "more", n=2, fmt="folder", max_controls=2, seed=3)  # two new samples: v2 carries 16
    for f in (tmp_path / "more").rglob("*.*"):
        dest = src / f.relative_to(tmp_path / "more")
        dest.parent.mkdir(parents=True, exist_ok=True)
        f.rename(dest.with_name("new_" + dest.name))
    from store.manifest_view import ManifestView

    whole, real = [], ManifestView.manifest
    monkeypatch.setattr(ManifestView, "manifest", property(lambda v: whole.append(v.table) or real.fget(v)))
    grown = stage.run(load_config(None, SMALL), src, out)
    monkeypatch.undo()
    assert whole == []
    again = stage.run(load_config(None, SMALL), src, tmp_path / "fresh2")
    assert grown.reused == 16 and grown.written == 2 and again.written == 18
    assert grown.controls == again.controls and grown.buckets == again.buckets
