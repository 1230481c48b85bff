"""Writer robustness: SIGKILL mid-run then resume, the lock, multi-rank writers merged by rank 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from schemas import UserError
from store import Store
from store.verify import verify_store
from store_samples import fill, key_of, sample, vae_schema
import warm_start

HERE = Path(__file__).parent
REPO = HERE.parent.parent

WRITE_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {here!r})
    from store import Store
    from store_samples import sample, vae_schema
    st = Store(sys.argv[1])
    n, kill_after, rank, world = (int(a) for a in sys.argv[2:6])
    w = st.writer("vae", vae_schema(), rank=rank, world_size=world, shard_size_mb=0.02)  # ~5 samples a shard
    print("resumed", len(w.done_keys), flush=True)
    for i in range(n):
        if i % world != rank:
            continue
        s = sample(i)
        if s["key"] in w.done_keys:
            continue
        if i == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-run: a shard is half written
        w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    if world == 1:
        w.commit()
    else:
        w.finish_rank()
""")


def run_writer(root: Path, n: int, kill_after: int, rank: int = 0, world: int = 1,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The writer in a process of its own, started warm (tests/warm_start.py: torch imported already, ~9 s of CPU
    each cold start); its SIGKILL, exit status and output are a cold start's."""
    script = WRITE_SCRIPT.format(here=str(HERE))
    return warm_start.run([sys.executable, "-c", script, str(root), str(n), str(kill_after), str(rank), str(world)],
                          cwd=REPO, timeout=120, env={**os.environ, **(env or {})})


def assert_exact(st: Store, n: int) -> None:
    r = st.reader("vae")
    assert r.keys() == sorted(key_of(i) for i in range(n))  # exactly one row per sample
    assert r.manifest.num_rows == n
    for i in range(n):
        got = r.tensors(key_of(i))
        for name, t in sample(i)["tensors"].items():
            assert torch.equal(got[name], t)


def test_sigkill_mid_run_then_resume(tmp_path: Path) -> None:
    root = tmp_path / "s"
    Store(root)
    killed = run_writer(root, 30, kill_after=20)
    assert killed.returncode == -signal.SIGKILL
    vdir = root / "vae" / "v1"
    committed = len(list(vdir.glob("*.index.parquet")))
    assert 0 < committed and not (vdir / "manifest.parquet").exists()
    tars = {p.name for p in vdir.glob("*.tar")}
    assert tars == {p.name.replace(".index.parquet", ".tar") for p in vdir.glob("*.index.parquet")}  # no half shard
    assert list(vdir.glob("*.tar.tmp"))  # the open shard died as a temp file (samples 18, 19 were in it)
    assert Store(root).tables() == {}  # nothing half-visible
    assert verify_store(root, progress=False) == []

    done = run_writer(root, 30, kill_after=-1)
    assert done.returncode == 0, done.stderr
    resumed = int(done.stdout.split()[1])
    assert 0 < resumed < 20  # continued from the committed shards, not from scratch
    assert not list(vdir.glob("*.tar.tmp"))
    st = Store(root)
    assert st.tables() == {"vae": 1}
    assert_exact(st, 30)
    assert verify_store(root, progress=False) == []


def test_second_writer_fails_fast_and_nothing_is_corrupted(store: Store) -> None:
    w = store.writer("vae", vae_schema(), shard_size_mb=0.004)
    s = sample(0)
    w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    with pytest.raises(UserError, match=r"table 'vae' \(rank 0\) is being written by pid \d+"):
        store.writer("vae", vae_schema())
    with pytest.raises(UserError, match="being written"):
        store.writer("vae", vae_schema("other-lineage"))  # a different version of the same table: still locked
    for i in range(1, 6):
        s = sample(i)
        w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    assert w.commit() == 1
    assert_exact(store, 6)
    assert fill(store, 2, tag="b") == 2  # lock released by commit


def test_two_rank_subprocesses_merge_into_one_sorted_manifest(tmp_path: Path) -> None:
    root = tmp_path / "s"
    Store(root)
    procs = [warm_start.WarmProcess([sys.executable, "-c", WRITE_SCRIPT.format(here=str(HERE)), str(root), "20",
                                     "-1", str(r), "2"], cwd=REPO)  # two processes, started warm as `run_writer`
             for r in range(2)]
    for code, _, err in warm_start.outcomes(procs, timeout=120):
        assert code == 0, err
    vdir = root / "vae" / "v1"
    assert {p.name[:9] for p in vdir.glob("shard-*.tar")} == {"shard-r00", "shard-r01"}
    st = Store(root)
    w0 = st.writer("vae", vae_schema(), rank=0, world_size=2)  # rank 0 after the barrier
    assert len(w0.done_keys) == 20
    assert w0.commit() == 1
    manifest = pq.read_table(vdir / "manifest.parquet")
    assert manifest.column("key").to_pylist() == sorted(key_of(i) for i in range(20))
    assert_exact(st, 20)


def test_commit_waits_for_every_rank_and_rejects_cross_rank_duplicates(store: Store) -> None:
    w0 = store.writer("vae", vae_schema(), rank=0, world_size=2, shard_size_mb=0.004)
    w1 = store.writer("vae", vae_schema(), rank=1, world_size=2, shard_size_mb=0.004)
    assert w0.version == w1.version == 1  # both ranks joined one version folder
    for w, idx in ((w0, [0, 1, 2]), (w1, [3, 2])):  # sample 2 written by both ranks
        for i in idx:
            s = sample(i)
            w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    with pytest.raises(UserError, match=r"ranks \[1\] have not finished"):
        w0.commit()
    with pytest.raises(UserError, match="only rank 0 commits"):
        w1.commit()
    w1.finish_rank()
    with pytest.raises(UserError, match="duplicate keys across shards"):
        w0.commit()
    assert store.tables() == {}


def test_a_commit_short_of_the_keys_its_ranks_were_given_is_refused(store: Store) -> None:
    """The rows plus the rejected samples must be the keys the ranks were given (each rank's rank-done file records
    both): a rank that lost a sample without rejecting it stops the commit in one line, nothing current."""
    w0 = store.writer("vae", vae_schema(), rank=0, world_size=2, shard_size_mb=0.004)
    w1 = store.writer("vae", vae_schema(), rank=1, world_size=2, shard_size_mb=0.004)
    for w, idx, given in ((w0, [0, 1], 3), (w1, [2, 3], 2)):  # rank 0 was given 3 keys: one neither written
        w.given = given                                        # nor rejected
        for i in idx:
            s = sample(i)
            w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    w1.finish_rank()
    with pytest.raises(UserError, match=r"4 rows plus 0 rejected samples, but the ranks were given 5 keys") as e:
        w0.commit()
    assert "\n" not in str(e.value) and store.tables() == {}
    w0 = store.writer("vae", vae_schema(), rank=0, world_size=2)  # the rerun: the lost key rejected this time
    w0.given = 3
    w0.finish_rank(rejected=1)
    assert w0.commit() == 1 and len(store.reader("vae")) == 4


def _complete_two_rank_version(store: Store) -> Path:
    w0 = store.writer("vae", vae_schema(), rank=0, world_size=2, shard_size_mb=0.004)
    w1 = store.writer("vae", vae_schema(), rank=1, world_size=2, shard_size_mb=0.004)
    for i in range(8):
        s = sample(i)
        (w0, w1)[i % 2].add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    w1.finish_rank()
    assert w0.commit() == 1
    return store.version_dir("vae", 1)


def test_a_lagging_view_of_a_complete_version_loses_none_of_its_files(store: Store, tmp_path: Path) -> None:
    """Rank 1's view of a shared store lags: it lists the complete v1's schema.json, its own rank-01.done and
    shards, but neither the manifest nor checksums.json written at the commit, nor its last shard's index (a
    cached lookup). Its writer opens v1 as in progress (an encoder then adopts v1 and closes it): opening used to
    delete rank-01.done and the "uncommitted" tar - files of a complete version, which then failed verify. A
    rank-done file is evidence that every shard of the rank was committed before it: nothing of the rank goes."""
    vdir = _complete_two_rank_version(store)
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    last = sorted(vdir.glob("shard-r01-*.index.parquet"))[-1]
    for p in (vdir / "manifest.parquet", vdir / "checksums.json", last):
        p.rename(hidden / p.name)  # what the lagging view does not show
    w1 = store.writer("vae", vae_schema(), rank=1, world_size=2, shard_size_mb=0.004)
    assert w1.version == 1  # in progress, as far as this view tells
    w1.close()
    for p in hidden.iterdir():
        p.rename(vdir / p.name)  # the view caught up
    assert (vdir / "rank-01.done").is_file() and (vdir / last.name.replace(".index.parquet", ".tar")).is_file()
    assert verify_store(store.root, progress=False) == []
    assert_exact(store, 8)


def test_a_rank_that_writes_again_after_its_done_file_is_cleaned_after_a_kill(store: Store) -> None:
    """The done file is kept at open, so it must not outlive new writing: a resumed rank that commits a new shard
    drops its done file first. Killed between a new tar and its index, the next writer leaves that tar (it cannot
    prove it uncommitted) and numbers its shards past it; the rerun then commits every sample once, without it."""
    w = store.writer("vae", vae_schema(), shard_size_mb=0.004)
    for i in range(4):
        s = sample(i)
        w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    w.finish_rank()  # killed before the commit
    w.close()
    vdir = store.version_dir("vae", 1)
    assert (vdir / "rank-00.done").is_file()
    w = store.writer("vae", vae_schema(), shard_size_mb=0.0001)  # a shard per sample
    assert len(w.done_keys) == 4
    s = sample(4)  # a sample rejected in the first run, accepted now
    w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])  # a shard of its own: committed
    assert not (vdir / "rank-00.done").exists()
    w.close()
    newest = sorted(vdir.glob("shard-r00-*.index.parquet"))[-1]
    newest.unlink()  # the kill between the tar and its index
    tar = vdir / newest.name.replace(".index.parquet", ".tar")
    w = store.writer("vae", vae_schema(), shard_size_mb=0.004)
    assert tar.exists() and len(w.done_keys) == 4
    s = sample(4)
    w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    assert w.commit() == 1
    assert_exact(store, 5)
    assert tar.name not in pq.read_table(vdir / "manifest.parquet").column("shard").to_pylist()
    assert verify_store(store.root, progress=False) == []
