"""A whole open (`local_store(..., whole=True)`, `pipeline store pull`) of a version this node's cache holds lazily
(metadata only, store/remote_shards.py): every shard the cache had not fetched yet is fetched now, each checked, so
the caller gets the whole version on disk - it got the metadata and only the shards some reader had read before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from store import Store
from store import format as fmt
from store.remote_cache import USAGE, local_store
from store.remote_shards import FETCH_TAG, MARKER, RANGED
from store.remote_pull import pull
from store.remote_push import push
from store_samples import fill


def _pushed(s3_env, store: Store) -> str:
    fill(store, 24, shard_size_mb=0.02)  # 4 shards of 6 samples
    push(store.root, s3_env.url())
    return s3_env.url()


def _shards(vdir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(vdir.iterdir()) if fmt.SHARD_RE.fullmatch(p.name)}


def _cache_bytes(cache: Path) -> int:
    """What the cache limit counts: every file but the lock files (store/remote_cache._counted) and the total."""
    return sum(p.stat().st_size for p in cache.rglob("*")
               if p.is_file() and not p.name.endswith(".lock") and p != cache / USAGE)


def test_a_whole_open_of_a_lazily_cached_version_fetches_its_missing_shards(s3_env, store: Store,
                                                                           tmp_path: Path) -> None:
    url = _pushed(s3_env, store)
    cache = tmp_path / "cache"
    root = local_store(url, ["vae"], cache, lease=False)  # lazily: metadata only
    vdir = fmt.version_dir(root, "vae", 1)
    with Store(root, create=False).reader("vae") as cached:  # one shard read by a scan: cached whole
        for k in cached.shard_groups()[0]:
            cached.tensors(k)
    assert len(_shards(vdir)) == 1
    limit = 10 * _cache_bytes(store.root)  # room for all of it: nothing evicted after the pull
    assert local_store(url, ["vae"], cache, limit_gb=limit / 1e9, whole=True, lease=False) == root
    assert _shards(vdir) == _shards(fmt.version_dir(store.root, "vae", 1))  # every shard, the remote's bytes
    assert (vdir / MARKER).is_file()  # still a copy of the remote's: evictable, never pushed back
    assert not [p for p in vdir.iterdir() if FETCH_TAG in p.name and not p.name.endswith(RANGED)
                or ".tmp-" in p.name]  # no temp file left
    # what the pull fetched is in the node's running total (a limited reader's next fetch counts from it)
    assert json.loads((cache / USAGE).read_text())["bytes"] == _cache_bytes(cache)


@pytest.mark.parametrize("damaged_ok", [False, True])
def test_store_pull_into_a_lazy_cache_completes_it(s3_env, store: Store, tmp_path: Path, damaged_ok: bool) -> None:
    """The same through `pull` itself (repair's and migrate's working copy hold older versions lazily; a current
    version there must be whole: they rewrite it). Repair's pull (`damaged_ok`) keeps a shard damaged on the server
    as it is, for its scan to find."""
    url = _pushed(s3_env, store)
    want = _shards(fmt.version_dir(store.root, "vae", 1))
    root = local_store(url, ["vae"], tmp_path / "cache", lease=False)
    if damaged_ok:
        bad = sorted(want)[2]
        data = bytearray(want[bad])
        data[len(data) // 2] ^= 0xFF
        s3_env.client().put_object(Bucket=s3_env.bucket, Key=f"store/vae/v1/{bad}", Body=bytes(data))
        want[bad] = bytes(data)
    summary = pull(url, root, tables=["vae"], damaged_ok=damaged_ok)
    assert summary.present == ["vae/v1"]
    assert summary.damaged == ([f"vae/v1/{bad}"] if damaged_ok else [])
    assert _shards(fmt.version_dir(root, "vae", 1)) == want


def test_a_working_copy_pulled_into_the_cache_folder_counts_against_a_readers_limit(s3_env, store: Store,
                                                                                    tmp_path: Path) -> None:
    """`store repair URL` / `migrate URL` pull the current versions whole (and now complete lazy ones) into
    `CACHE/.work/`, which the cache's walk counts against `--cache-gb`. A limited reader of the node kept adding its
    fetches to the running total taken before that pull, so it fetched on past its limit by the working copy's
    size until some walk; now the pull drops the total and the reader's next fetch walks (evicts, or reads by
    range)."""
    from store.remote_work import work_copy

    url = _pushed(s3_env, store)
    cache = tmp_path / "cache"
    local_store(url, ["vae"], cache, lease=False)
    metadata = _cache_bytes(cache)
    shard = max(len(b) for b in _shards(fmt.version_dir(store.root, "vae", 1)).values())
    work = _cache_bytes(store.root)  # about what the working copy holds
    limit = metadata + work + shard + shard // 2  # the working copy and one shard fit, two shards do not
    root = local_store(url, ["vae"], cache, limit_gb=limit / 1e9, lease=False)
    with Store(root, create=False).reader("vae") as cached:
        groups = cached.shard_groups()
        for k in groups[0]:  # a scan: one shard fetched whole
            cached.tensors(k)
        work_copy(url, cache)  # another command of the node: repair's working copy
        assert _cache_bytes(cache) <= limit
        for k in groups[1]:  # the next whole fetch must not take the cache past its limit
            cached.tensors(k)
    assert _cache_bytes(cache) <= limit


def test_a_whole_open_lets_the_nodes_other_readers_fetch_while_it_downloads(s3_env, store: Store, tmp_path: Path,
                                                                            monkeypatch) -> None:
    """A whole open held the node's cache lock through its whole pull, and a shard fetch of every other reader of
    the node takes that lock to reserve its bytes: they all waited for the pull (hours at scale). Now the pull
    downloads without it. Here the pull is held inside its first download until another reader of the cache has
    fetched a shard whole (a deadlock before: the guard below fails it); then each shard was fetched once, the
    cache's running total is its bytes, and nothing of the pull is left (temp files, its lease)."""
    import threading

    from store import remote, remote_download, remote_shards
    from store.lease import LEASES_DIR

    url = _pushed(s3_env, store)
    cache, limit = tmp_path / "cache", 10 * _cache_bytes(store.root)
    root = local_store(url, ["vae"], cache, limit_gb=limit / 1e9, lease=False)  # a reader's open: metadata only
    vdir = fmt.version_dir(root, "vae", 1)
    want = _shards(fmt.version_dir(store.root, "vae", 1))
    before = remote_shards.fetch_stats()["shards"]
    monkeypatch.setattr(remote, "TRANSFERS", 1)  # the pull fetches in shard order: held in the first, not the last
    reader: dict = {}
    pulling, read = threading.Event(), threading.Event()
    real = remote_download.pieces

    def held(*args, **kwargs):
        if threading.get_ident() != reader.get("thread"):  # the pull's download waits for the reader
            pulling.set()
            read.wait(timeout=600)
        yield from real(*args, **kwargs)

    monkeypatch.setattr(remote_download, "pieces", held)
    outcome: dict = {}

    def pull_whole() -> None:
        try:
            outcome["root"] = local_store(url, ["vae"], cache, limit_gb=limit / 1e9, whole=True, lease=False)
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            outcome["error"] = e

    def read_last_shard() -> None:
        reader["thread"] = threading.get_ident()
        outcome["problem"] = remote_shards.fetch_problem(vdir / sorted(want)[-1])  # a scan's whole fetch
        read.set()

    puller = threading.Thread(target=pull_whole)
    puller.start()
    assert pulling.wait(timeout=600)  # the pull is downloading its first shard now
    threading.Thread(target=read_last_shard, daemon=True).start()
    fetched = read.wait(timeout=120)  # a deadlock guard, not a timing: the reader needs a lock or nothing
    read.set()  # the pull goes on either way
    puller.join()
    assert fetched, "another reader of the node could not fetch a shard while a whole open downloaded"
    assert outcome.get("error") is None and outcome["problem"] is None and outcome["root"] == root
    assert _shards(vdir) == want  # every shard, the remote's bytes
    assert remote_shards.fetch_stats()["shards"] - before == len(want)  # each fetched (and reserved) once
    assert json.loads((cache / USAGE).read_text())["bytes"] == _cache_bytes(cache)
    assert not [p for p in vdir.iterdir() if FETCH_TAG in p.name and not p.name.endswith(RANGED)]
    assert not list((root / LEASES_DIR).glob("*"))  # the pull's lease released


KILLED_PULL = """
import sys
from pathlib import Path
from store import remote, remote_shards
from store.remote_cache import local_store
remote.TRANSFERS = 1  # one download under way: one line printed
def stalled(remote, rel, part):  # the download under way when the kill comes: its temp file is there
    print(part, flush=True)
    sys.stdin.readline()
remote_shards._download = stalled
local_store(sys.argv[1], ["vae"], Path(sys.argv[2]), limit_gb=float(sys.argv[3]), whole=True, lease=False)
"""


def test_a_whole_open_killed_mid_download_leaves_what_the_next_open_removes(s3_env, store: Store,
                                                                           tmp_path: Path) -> None:
    """A whole open killed with -9 inside a download (no cache lock held then): its shard's temp file (reserved at
    full size) and its lease file are a dead process's; the next whole open removes both, fetches every shard, and
    counts the cache's bytes once."""
    import os
    import signal
    import subprocess
    import sys

    from store.lease import LEASES_DIR

    url = _pushed(s3_env, store)
    cache, limit_gb = tmp_path / "cache", 10 * _cache_bytes(store.root) / 1e9
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PULL, url, str(cache), str(limit_gb)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        part = Path(proc.stdout.readline().strip())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    root = part.parent.parent.parent
    assert FETCH_TAG in part.name and part.stat().st_size > 0 and list((root / LEASES_DIR).glob("*"))
    assert local_store(url, ["vae"], cache, limit_gb=limit_gb, whole=True, lease=False) == root
    vdir = fmt.version_dir(root, "vae", 1)
    assert _shards(vdir) == _shards(fmt.version_dir(store.root, "vae", 1))
    assert not part.exists() and not [p for p in vdir.iterdir() if FETCH_TAG in p.name and not p.name.endswith(RANGED)]
    assert not list((root / LEASES_DIR).glob("*"))  # the killed pull's lease, judged dead, removed
    assert json.loads((cache / USAGE).read_text())["bytes"] == _cache_bytes(cache)
