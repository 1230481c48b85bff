"""What dead processes leave in a URL's cache, removed by its eviction, judged by store/lease.py's one rule (a pid
gone, ended - a zombie - or reused by another process): the temp files of killed fetches (before, `kill(pid, 0)`
alone kept a zombie's or a reused pid's for ever) and the lease files of killed readers in the cached store
(before, only an explicit `store gc` of the cache's store removed them: one per killed run piled up)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from store import Store
from store import format as fmt
from store import lease
from store.remote_cache import local_store
from store.remote_shards import FETCH_TAG
from store.remote_sync import push
from store_samples import fill


def _env() -> dict[str, str]:
    """The S3 test server's settings (set by the fixture) for a child process."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def _cache_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_the_temp_files_of_a_zombie_fetcher_and_of_a_reused_pid_are_evicted_first(s3_env, store: Store,
                                                                                  tmp_path: Path) -> None:
    fill(store, 24, shard_size_mb=0.02)
    push(store.root, s3_env.url())
    cache = tmp_path / "cache"
    vdir = fmt.version_dir(local_store(s3_env.url(), ["vae"], cache), "vae", 1)
    # a fetcher killed with -9 whose parent has not reaped it yet: its pid still answers kill(pid, 0)
    zombie = subprocess.Popen([sys.executable, "-c", "from store.lease import process_tag; print(process_tag())"],
                              stdout=subprocess.PIPE, text=True, env=_env())
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        tag = zombie.stdout.readline().strip()
        deadline = time.monotonic() + 120  # a bound for a loaded machine: ends once the child has exited
        while _state(zombie.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(zombie.pid) == "Z" and tag.startswith(f"{zombie.pid}-")
        start = lease._proc_start(unrelated.pid)
        orphans = [vdir / f".shard-r00-000000.tar{FETCH_TAG}{tag}-1",  # the zombie's
                   vdir / f".shard-r00-000001.tar{FETCH_TAG}{zombie.pid}-1",  # the same, named by an earlier release
                   vdir / f".shard-r00-000002.tar{FETCH_TAG}{unrelated.pid}-{start - 1}-1"]  # pid now another's
        for p in orphans:
            p.write_bytes(b"x" * 50_000)
        mine = vdir / f".shard-r00-000003.tar{FETCH_TAG}{lease.process_tag()}-1"
        mine.write_bytes(b"x" * 10)  # a fetch of a live process: kept
        local_store(s3_env.url(), ["vae"], cache, limit_gb=(_cache_bytes(cache) - 3 * 50_000) / 1e9)
        assert [p.name for p in orphans if p.exists()] == [] and mine.exists()
    finally:
        for proc in (zombie, unrelated):
            proc.kill()
            proc.wait()


CACHED_READER = """
import sys
from pathlib import Path
from store import lease
from store.remote_cache import local_store
root = local_store(sys.argv[1], ["vae"], Path(sys.argv[2]), lease=False)
held = lease.hold(root, {"vae": None}, "a reader of the URL")  # as train's reader: a lease file in the cache
print(held.path, flush=True)
sys.stdin.readline()
"""


def test_eviction_removes_the_lease_files_of_killed_readers_in_the_cache(s3_env, store: Store,
                                                                         tmp_path: Path) -> None:
    fill(store, 6)
    push(store.root, s3_env.url())
    cache = tmp_path / "cache"
    killed = []
    for _ in range(2):  # two runs killed with -9: each leaves its lease file in the cached store
        proc = subprocess.Popen([sys.executable, "-c", CACHED_READER, s3_env.url(), str(cache)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
        try:
            killed.append(Path(proc.stdout.readline().strip()))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert all(p.is_file() for p in killed)
    root = killed[0].parent.parent
    live = lease.hold(root, {"vae": None}, "this reader")
    try:
        local_store(s3_env.url(), ["vae"], cache, limit_gb=1.0, lease=False)  # an open with a limit evicts
        assert [p for p in killed if p.exists()] == [] and live.path.is_file()
    finally:
        live.release()
