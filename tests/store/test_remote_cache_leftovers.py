"""What dead processes leave in a URL's cache, removed by its eviction, judged by store/lease.py's one rule (a pid
gone, ended - a zombie - or reused by another process): the temp files of killed fetches (before, `kill(pid, 0)`
alone kept a zombie's or a reused pid's for ever) and the lease files of killed readers in the cached store
(before, only an explicit `store gc` of the cache's store removed them: one per killed run piled up), also by an
open without a limit (which evicts nothing). A temp file of another pid namespace (a container sharing the cache
folder) is judged by its age, never by a pid that is not this namespace's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from store import Store
from store import format as fmt
from store import lease
from store.remote_cache import USAGE, local_store
from store.remote_shards import FETCH_TAG
from store.remote_push import push
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
from store.remote_cache import USAGE, local_store
root = local_store(sys.argv[1], ["vae"], Path(sys.argv[2]), lease=False)
held = lease.hold(root, {"vae": None}, "a reader of the URL")  # as train's reader: a lease file in the cache
print(held.path, flush=True)
sys.stdin.readline()
"""


def _killed_after_first_line(script: str, url: str, cache: Path) -> Path:
    """The path a child running `script URL CACHE` prints first; the child is killed with -9 right after."""
    proc = subprocess.Popen([sys.executable, "-c", script, url, str(cache)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=_env())
    try:
        return Path(proc.stdout.readline().strip())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.fixture
def killed_reader(s3_env, store: Store, tmp_path: Path):
    """(the cache, the lease file a reader of the URL killed with -9 left in the cached store, a live reader's lease
    beside it). One killed run only: an open without a limit, as that reader's, removes the lease files of killed
    readers too."""
    fill(store, 6)
    push(store.root, s3_env.url())
    cache = tmp_path / "cache"
    killed = _killed_after_first_line(CACHED_READER, s3_env.url(), cache)
    assert killed.is_file()
    live = lease.hold(killed.parent.parent, {"vae": None}, "this reader")
    yield cache, killed, live
    live.release()


def test_eviction_removes_the_lease_files_of_killed_readers_in_the_cache(s3_env, killed_reader) -> None:
    cache, killed, live = killed_reader
    local_store(s3_env.url(), ["vae"], cache, limit_gb=1.0, lease=False)  # an open with a limit evicts
    assert not killed.exists() and live.path.is_file()


def _gone_pid() -> int:
    """The pid of a process that has exited and been reaped (a pid nothing answers to here)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _a_byte_less(cache: Path) -> float:
    """A limit (GB) a byte under what the cache's versions hold (the running total, outside them, left out)."""
    (cache / USAGE).unlink(missing_ok=True)
    return (_cache_bytes(cache) - 1) / 1e9


def _shards(vdir: Path) -> list[Path]:
    return sorted(p for p in vdir.iterdir() if fmt.SHARD_RE.fullmatch(p.name))


def test_a_fetch_temp_file_of_another_pid_namespace_is_kept_while_fresh_and_evicted_once_old(
        s3_env, store: Store, tmp_path: Path) -> None:
    """Containers sharing one cache folder number their processes apart: another namespace's pid 123 may be a live
    fetch while pid 123 here is gone or another process. Before, such a live fetch's temp file was deleted."""
    assert f"-n{os.stat('/proc/self/ns/pid').st_ino}" in lease.process_tag()  # this process's fetches say whose
    fill(store, 24, shard_size_mb=0.02)
    push(store.root, s3_env.url())
    cache = tmp_path / "cache"
    vdir = fmt.version_dir(local_store(s3_env.url(), ["vae"], cache, whole=True, lease=False), "vae", 1)
    shards = _shards(vdir)
    assert len(shards) > 2
    other = os.stat("/proc/self/ns/pid").st_ino + 1
    foreign = vdir / f".{shards[0].name}{FETCH_TAG}{_gone_pid()}-12345-n{other}-1"
    foreign.write_bytes(b"x" * 50_000)
    # over the limit by a byte: a killed fetch's temp file would go first (its last use counts as 0)
    local_store(s3_env.url(), ["vae"], cache, limit_gb=_a_byte_less(cache), lease=False)
    assert foreign.exists(), "a fresh temp file of another pid namespace was judged dead by a pid of this one"
    assert len(_shards(vdir)) == len(shards) - 1  # a shard went instead
    old = time.time() - lease.STALE_SECONDS - 60  # not written to for longer than the leases' margin
    os.utime(foreign, (old, old))
    local_store(s3_env.url(), ["vae"], cache, limit_gb=_a_byte_less(cache), lease=False)
    assert not foreign.exists() and len(_shards(vdir)) == len(shards) - 1  # the stale one went, first


NAMESPACED_FETCHER = "from store.lease import process_tag; print(process_tag(), flush=True); input()"


def test_a_live_fetcher_in_its_own_pid_namespace_keeps_its_temp_file(s3_env, store: Store, tmp_path: Path) -> None:
    """The same with a real pid namespace (unshare, where user namespaces are allowed): the fetcher is pid 1 there,
    and pid 1 here is another process (another start time). Before, its temp file was evicted."""
    fill(store, 24, shard_size_mb=0.02)
    push(store.root, s3_env.url())
    cache = tmp_path / "cache"
    vdir = fmt.version_dir(local_store(s3_env.url(), ["vae"], cache, whole=True, lease=False), "vae", 1)
    try:
        proc = subprocess.Popen(["unshare", "-Urpf", "--mount-proc", sys.executable, "-c", NAMESPACED_FETCHER],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env())
    except FileNotFoundError:
        pytest.skip("no unshare here")
    try:
        tag = proc.stdout.readline().strip()
        if not tag:
            pytest.skip(f"no pid namespace of its own here: {proc.stderr.read().strip()[:200]}")
        assert tag.startswith("1-") and "-n" in tag
        live = vdir / f".{_shards(vdir)[0].name}{FETCH_TAG}{tag}-1"
        live.write_bytes(b"x" * 50_000)
        local_store(s3_env.url(), ["vae"], cache, limit_gb=_a_byte_less(cache), lease=False)
        assert live.exists()
    finally:
        proc.kill()
        proc.wait()


def test_an_open_without_a_limit_removes_the_lease_files_of_killed_readers(s3_env, killed_reader) -> None:
    """Without --cache-gb nothing evicts, and the lease files of killed readers piled up in the cached store's
    `.leases/` for ever (one per kill -9). An open removes them now, judged as eviction judges them."""
    cache, killed, live = killed_reader
    local_store(s3_env.url(), ["vae"], cache, lease=False)  # no limit
    assert not killed.exists() and live.path.is_file()


def test_a_fetch_whose_temp_file_was_evicted_meanwhile_reads_by_range(s3_env, store: Store, tmp_path: Path,
                                                                     monkeypatch) -> None:
    """A fetch paused past the margin (SIGSTOP) has its temp file taken for a killed one's by another container's
    eviction: its samples are read by range, no error (before, the rename raised FileNotFoundError mid-read)."""
    import torch

    from store import remote_shards

    fill(store, 24, shard_size_mb=0.02)
    push(store.root, s3_env.url())
    real = remote_shards._download

    def then_evicted(remote, rel, part):
        got = real(remote, rel, part)
        part.unlink()
        return got

    monkeypatch.setattr(remote_shards, "_download", then_evicted)
    root = local_store(s3_env.url(), ["vae"], tmp_path / "cache", lease=False)
    with store.reader("vae") as local, Store(root, create=False).reader("vae") as cached:
        for group in local.shard_groups():  # a scan: each shard fetched whole
            for k in group:
                a, b = cached.tensors(k), local.tensors(k)
                assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    vdir = fmt.version_dir(root, "vae", 1)
    assert not [p for p in vdir.iterdir() if fmt.SHARD_RE.fullmatch(p.name) or FETCH_TAG in p.name
                and not p.name.endswith("ranged")]  # nothing cached, nothing left behind


@pytest.mark.parametrize("where", ["download", "running total"])
def test_a_full_disk_under_a_scan_reads_by_range_and_caches_again_once_there_is_room(s3_env, store: Store,
                                                                                     tmp_path: Path, monkeypatch,
                                                                                     caplog, where: str) -> None:
    """The cache's disk filled by other files (its limit counts only its own): a scan's whole fetch meets ENOSPC,
    writing the shard or the node's running total, and the samples are read by range, checked, with one warning and
    one try per `FULL_RETRY_S` (before, a DiskFullError - or the bare OSError of the total - stopped every rank of
    the node mid-run, and its rerun met the same disk); once there is room the scan caches whole shards again. A
    whole open, which promises every shard, still stops on the full disk."""
    import errno
    import logging

    import torch

    from store import remote_cache, remote_shards
    from store.io_errors import DiskFullError

    fill(store, 24, shard_size_mb=0.02)
    push(store.root, s3_env.url())
    real, tries = remote_shards._download, []

    def disk_full(remote, rel, part):
        tries.append(rel)
        part.write_bytes(b"x" * 100)  # what fitted before the disk was full
        raise OSError(errno.ENOSPC, "No space left on device")

    def total_on_full_disk(cache, total):
        tries.append(total)
        raise OSError(errno.ENOSPC, "No space left on device")

    real_total = remote_cache._write_usage
    root = local_store(s3_env.url(), ["vae"], tmp_path / "cache", limit_gb=1.0, lease=False)
    if where == "download":
        monkeypatch.setattr(remote_shards, "_download", disk_full)
    else:
        monkeypatch.setattr(remote_cache, "_write_usage", total_on_full_disk)
    vdir = fmt.version_dir(root, "vae", 1)

    def scan() -> None:
        with store.reader("vae") as local, Store(root, create=False).reader("vae") as cached:
            for group in local.shard_groups():
                for k in group:
                    a, b = cached.tensors(k), local.tensors(k)
                    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

    with caplog.at_level(logging.WARNING, logger="store"):
        scan()
    assert len(tries) == 1 and len([r for r in caplog.records if "the disk of the store cache" in r.getMessage()]) == 1
    assert not [p for p in vdir.iterdir() if fmt.SHARD_RE.fullmatch(p.name) or FETCH_TAG in p.name
                and not p.name.endswith("ranged")]  # nothing cached, no temp file left
    with pytest.raises(DiskFullError, match="disk full while writing the store cache"):
        local_store(s3_env.url(), ["vae"], tmp_path / "cache", whole=True, lease=False)

    monkeypatch.setattr(remote_shards, "_download", real)  # room again, and the spell over
    monkeypatch.setattr(remote_cache, "_write_usage", real_total)
    monkeypatch.setattr(remote_shards, "FULL_RETRY_S", 0.0)
    remote_shards.fetcher_for(vdir)._full_until = 0.0
    scan()
    assert sorted(p.name for p in vdir.iterdir() if fmt.SHARD_RE.fullmatch(p.name)) == \
        sorted(p.name for p in fmt.version_dir(store.root, "vae", 1).iterdir() if fmt.SHARD_RE.fullmatch(p.name))


KILLED_FETCHER = """
import sys
from pathlib import Path
from store import format as fmt, remote_shards
from store.remote_cache import local_store
root = local_store(sys.argv[1], ["vae"], Path(sys.argv[2]), lease=False)
def stalled(remote, rel, part):  # the download under way when the kill comes: its temp file is there
    print(part, flush=True)
    sys.stdin.readline()
remote_shards._download = stalled
fetcher = remote_shards.fetcher_for(fmt.version_dir(root, "vae", 1))
fetcher.fetch_whole(sorted(n for n in fetcher.sums if remote_shards.is_shard(n))[0])
"""


@pytest.mark.parametrize("limit_gb", [None, 1.0], ids=["no-limit", "under-the-limit"])
def test_an_open_removes_the_temp_file_of_a_killed_fetch_and_keeps_a_live_ones(s3_env, store: Store,
                                                                                tmp_path: Path, limit_gb) -> None:
    """Eviction removed a killed fetch's temp file only when the cache was over its limit: without --cache-gb (or
    under it) one shard-sized file per killed fetch piled up for ever. An open removes them now, by eviction's rule
    (store/lease.tag_gone): a fetch of a live process keeps its file."""
    fill(store, 24, shard_size_mb=0.02)
    push(store.root, s3_env.url())
    cache = tmp_path / "cache"
    killed = _killed_after_first_line(KILLED_FETCHER, s3_env.url(), cache)
    assert FETCH_TAG in killed.name and killed.stat().st_size > 0  # created at its full size, never renamed
    live = killed.with_name(killed.name.split(FETCH_TAG)[0] + f"{FETCH_TAG}{lease.process_tag()}-1")
    live.write_bytes(b"x" * 10)  # a fetch of this (live) process under way
    local_store(s3_env.url(), ["vae"], cache, limit_gb=limit_gb, lease=False)
    assert not killed.exists() and live.exists()
