"""A duplicate (same target, controls and caption) of a sample whose first copy the rendering rejects (its mask
is damaged) was dropped as a "duplicate" of a sample the table does not hold: the edit pair was lost although a
good copy of it was in the source. Now the next copy with another mask is rendered instead, the same table
whatever the worker count."""

from __future__ import annotations

import io
import os
import sys

import numpy as np
import pytest
from PIL import Image

from test_resize_bucket import SMALL, cfg, png, put, rgb
from stages.resize.stage import run
from store import Store
import warm_start  # the killed and rerun resizes: real processes, started warm


def _mask(left: int, size: tuple[int, int] = (64, 48)) -> bytes:
    m = Image.new("L", size, 0)
    m.paste(255, (0, 0, left, size[1]))
    return png(m)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("dups") / "src"
    target, control = png(rgb(64, 48)), png(rgb(64, 64, (10, 200, 10)))
    put(root, "a1", target, controls=[control], mask=b"\x89PNG\r\n\x1a\n garbage")  # first copy: a damaged mask
    put(root, "a2", target, controls=[control], mask=_mask(16))  # the copy kept instead
    put(root, "a3", target, controls=[control], mask=_mask(40))  # a duplicate of a2
    put(root, "a4", target, controls=[control], mask=b"\x89PNG\r\n\x1a\n garbage")  # same mask as a1: not revived
    put(root, "b1", png(rgb(48, 64, (0, 0, 200))), controls=[control])
    put(root, "b2", png(rgb(48, 64, (0, 0, 200))), controls=[control])  # a plain duplicate of a kept sample
    return root


@pytest.mark.parametrize("workers", [0, 2])
def test_the_next_copy_of_a_sample_whose_first_copy_was_rejected_is_kept(source, tmp_path, workers):
    store = tmp_path / "store"
    summary = run(cfg(workers=workers), source, store)
    st = Store(store)
    rows = {r["source"].rsplit("/", 1)[-1]: r for r in st.reader("images").manifest.to_pylist()}
    assert set(rows) == {"a2.png", "b1.png"}, rows
    # the revived copy keeps its caption (it was stored as "": encode-text encoded an empty instruction for it)
    assert rows["a2.png"]["caption"] == rows["b1.png"]["caption"] == "make it blue"
    mask = np.asarray(Image.open(io.BytesIO(st.reader("images").files(rows["a2.png"]["key"])["mask.png"])))
    assert mask[:, :8].min() == 255 and mask[:, 24:].max() == 0  # a2's mask (left 16 px edited), not a3's
    q = {r["source"].rsplit("/", 1)[-1]: r for r in st.quarantine().to_pylist()}
    assert {k: r["reason"] for k, r in q.items()} == {"a1.png": "bad-mask", "a3.png": "duplicate",
                                                      "a4.png": "duplicate", "b2.png": "duplicate"}
    assert q["a3.png"]["detail"].endswith("a2.png")  # names the copy the table holds
    assert summary.written == 2 and summary.quarantined["duplicate"] == 3 and summary.quarantined["bad-mask"] == 1
    kept = {(a.rsplit("/", 1)[-1], b.rsplit("/", 1)[-1]) for a, b in summary.duplicates}
    assert kept == {("a2.png", "a3.png"), ("a1.png", "a4.png"), ("b1.png", "b2.png")}


BAD = b"\x89PNG\r\n\x1a\n garbage"
KILLED = ("import sys; from pipeline.config import load_config; from stages.resize.stage import run;"
          f"run(load_config(None, {{**{SMALL!r}, 'resize.shard_size_mb': 0.0001}}), sys.argv[1], sys.argv[2])")


def _record(store) -> tuple:
    """The table's rows (source -> mask bytes) and the quarantine's (source -> reason, detail), by file name."""
    st = Store(store)
    with st.reader("images") as r:
        rows = {m["source"].rsplit("/", 1)[-1]: r.files(k).get("mask.png")
                for k, m in zip(r.keys(), r.manifest.to_pylist())}
    q = {r["source"].rsplit("/", 1)[-1]: (r["reason"], r["detail"].rsplit("/", 1)[-1])
         for r in st.quarantine().to_pylist()}
    return rows, q


@pytest.mark.parametrize("masks", [[BAD, _mask(16), _mask(40), BAD],  # the first held copy is kept
                                   [BAD, BAD + b" 2", _mask(40), BAD]])  # the second: the first held one fails too
def test_a_revived_copy_kept_before_a_kill_keeps_its_rows_on_resume(tmp_path, masks):
    """Killed right after the revived copy's shard was committed (its quarantine rows are written at the commit),
    the rerun resumes: the first copy's key is in the table, but under the later copy's source. It was counted
    resumed as if it were the copy the table holds (its bad-mask row lost), and the copy the table does hold was
    quarantined as its "duplicate" (the later copies named it as theirs). Now the rows are an uninterrupted run's."""
    src = tmp_path / "src"
    target, control = png(rgb(64, 48)), png(rgb(64, 64, (10, 200, 10)))
    for i, mask in enumerate(masks):
        put(src, f"a{i + 1}", target, controls=[control], mask=mask)
    fresh = run(cfg(shard_size_mb=0.0001), src, tmp_path / "fresh")
    killed = warm_start.run([sys.executable, "-c", KILLED, str(src), str(tmp_path / "store")],
                           env={**os.environ, "STORE_CRASH_AT": "after_shard_commit"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (tmp_path / "store" / "quarantine.parquet").exists()  # killed before the commit wrote the rows
    resumed = run(cfg(shard_size_mb=0.0001), src, tmp_path / "store")
    assert resumed.resumed == 1 and resumed.written == 0
    assert _record(tmp_path / "store") == _record(tmp_path / "fresh")
    assert set(_record(tmp_path / "fresh")[0]) == {"a3.png" if masks[1].startswith(BAD) else "a2.png"}
    assert resumed.quarantined == fresh.quarantined and sorted(resumed.duplicates) == sorted(fresh.duplicates)


def test_a_copy_that_renders_on_resume_after_failing_before_the_kill_stays_out(tmp_path):
    """The interrupted run lost the first copy's worker (nothing about its bytes: a rerun renders it) and kept the
    next copy instead. The resumed run counted the first copy resumed and quarantined the copy the table holds
    as its duplicate; it must neither do that nor add the first copy under the key the table already holds (the
    writer refuses a key twice: every rerun would fail), but record it as a duplicate of the copy kept."""
    src = tmp_path / "src"
    target, control = png(rgb(64, 48)), png(rgb(64, 64, (10, 200, 10)))
    for i, left in enumerate([8, 16, 40]):
        put(src, f"a{i + 1}", target, controls=[control], mask=_mask(left))
    died = ("from schemas.errors import Rejected; from stages.resize import rendering; real = rendering.render\n"
            "rendering.render = lambda rec, key, *a: (Rejected('worker-died', 'killed', key=key)\n"
            "    if rec.source.endswith('a1.png') else real(rec, key, *a))\n")
    killed = warm_start.run([sys.executable, "-c", died + KILLED, str(src), str(tmp_path / "store")],
                           env={**os.environ, "STORE_CRASH_AT": "after_shard_commit"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run(cfg(shard_size_mb=0.0001), src, tmp_path / "store")
    rows, q = _record(tmp_path / "store")
    assert set(rows) == {"a2.png"} and resumed.resumed == 1 and resumed.written == 0
    assert q == {"a1.png": ("duplicate", "a2.png"), "a3.png": ("duplicate", "a2.png")}
    assert sorted(resumed.duplicates) == sorted([(str(src / "target" / "a2.png"), str(src / "target" / f"a{i}.png"))
                                                 for i in (1, 3)])



def test_a_resumed_sample_whose_source_name_is_not_found_is_still_resumed(tmp_path, monkeypatch):
    """Which copy the resumed version holds is told by source name (the readers skip those samples' bytes); were
    a name not found (none should be: a resume needs the same schema, hence the same source path), the copy with
    the recorded mask is the one held: counted resumed as before, not rendered again and quarantined as a
    duplicate of itself. (A guard for the revival fix, which renders a first copy the table does not hold.)"""
    from stages.resize import resumed_sources

    src = tmp_path / "src"
    target, control = png(rgb(64, 48)), png(rgb(64, 64, (10, 200, 10)))
    for i, mask in enumerate([BAD, _mask(16), _mask(40)]):
        put(src, f"a{i + 1}", target, controls=[control], mask=mask)
    put(src, "b1", png(rgb(48, 64, (0, 0, 200))), controls=[control], mask=_mask(8, (48, 64)))  # the first shard
    fresh = run(cfg(shard_size_mb=0.0001), src, tmp_path / "fresh")
    killed = warm_start.run([sys.executable, "-c", KILLED, str(src), str(tmp_path / "store")],
                           env={**os.environ, "STORE_CRASH_AT": "after_shard_commit"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    monkeypatch.setattr(resumed_sources, "resumed_sources", lambda vdir: resumed_sources.ResumedSources([]))
    resumed = run(cfg(shard_size_mb=0.0001), src, tmp_path / "store")
    assert resumed.version == 1 and resumed.resumed == 1 and resumed.written == 1
    assert _record(tmp_path / "store") == _record(tmp_path / "fresh")
    assert set(_record(tmp_path / "store")[0]) == {"a2.png", "b1.png"} and resumed.quarantined == fresh.quarantined
