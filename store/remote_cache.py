"""A store at a URL read through a bounded local cache: the versions a reader needs, pulled when it opens them.

`local_store(url, tables, cache_dir, limit_gb)` pulls the current versions of `tables` (every file checked, as
`pipeline store pull`) into `cache_dir/<hash of url>/`, a local store the reader then opens as any other, and
evicts least recently used versions beyond the size limit. Versions are immutable, so a cached version never goes
stale; a newer current version on the remote is pulled beside it on the next open. Processes of one node share the
cache: pulls and evictions run under one lock on the cache folder (the first process pulls, the others wait and
find it there), and a version a live reader holds a read lease on (store/lease.py, written by train's reader
inside the cached store) is never evicted.

A writer (the encoders) works on the cached copy and then pushes it back (`push_back`): the remote commit keeps
push's guarantees (write-once objects, manifest last, store.json by compare-and-swap), so a killed encoder leaves
nothing visible on the remote and a rerun resumes from the cached copy's committed shards.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from schemas.errors import UserError
from store import format as fmt
from store import lease as leases
from store.io_errors import writing
from store.remote import is_url



def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "qwen-edit-pipeline" / "stores"

CACHE_LOCK = ".cache.lock"
EVICTING = ".evicting"


def local_store(store: str | Path, tables: list[str] | None, cache_dir: str | Path | None = None,
                limit_gb: float | None = None, storage_options: dict[str, Any] | None = None,
                optional: tuple[str, ...] = (), lease: bool = True) -> Path:
    """`store` itself when it is a local folder; for a URL, the cached local copy holding `tables`' current
    versions (pulled now if missing; those in `optional` only when the remote has them). `tables=None`: every
    complete version the remote holds (what `store verify` checks)."""
    if not is_url(store):
        return Path(store)
    from store.remote_sync import pull

    url = str(store).rstrip("/")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    root = cache / hashlib.sha256(url.encode()).hexdigest()[:16]
    with fmt.flock(cache / CACHE_LOCK), writing("the store cache", cache):
        pulled = pull(url, root, storage_options, tables=tables, optional=optional)
        current = fmt.read_store_record(root)["tables"]
        if tables is None:
            needed = {(t, int(v)) for t, v in (name.rsplit("/v", 1) for name in pulled.copied + pulled.present)}
        else:
            needed = {(t, int(current[t]["current"])) for t in tables if t in current}
        for t, v in needed:
            os.utime(fmt.version_dir(root, t, v))  # last use, for LRU
        if limit_gb is not None:
            evict(cache, int(limit_gb * 1e9), {(root, t, v) for t, v in needed})
        (root / "source-url.txt").write_text(url + "\n")  # which remote this cached store copies, for a human
    if lease:  # a lease object on the remote naming what this process reads, till it exits (store/remote_lease.py)
        from store.remote_lease import hold_reading

        hold_reading(url, sorted(needed), storage_options)
    return root


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def evict(cache: Path, limit: int, keep: set[tuple[Path, str, int]]) -> list[Path]:
    """Remove least recently used cached versions until the cache holds at most `limit` bytes (call under the
    cache lock). Kept: `keep` and versions with a live read lease. UserError when the kept ones alone exceed it."""
    versions = []  # (last use, bytes, root, table, version)
    for root in sorted(p for p in cache.iterdir() if p.is_dir()):
        if not (root / fmt.STORE_JSON).is_file():
            continue
        leased = {(t, v) for found in leases.leases(root) if found.live for t, v in found.versions()}
        for table_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            for v in fmt.list_versions(root, table_dir.name):
                vdir = fmt.version_dir(root, table_dir.name, v)
                pinned = (root, table_dir.name, v) in keep or (table_dir.name, v) in leased
                versions.append((vdir.stat().st_mtime, _size(vdir), pinned, vdir))
    total = sum(n for _, n, _, _ in versions)
    removed = []
    for _, n, pinned, vdir in sorted(versions, key=lambda x: x[0]):
        if total <= limit:
            break
        if pinned:
            continue
        # renamed first (no longer a version name: an opening reader sees it gone, never half-deleted)
        doomed = vdir.with_name(f".{vdir.name}{EVICTING}")
        os.rename(vdir, doomed)
        shutil.rmtree(doomed)
        total -= n
        removed.append(vdir)
    if total > limit:
        raise UserError(f"the store cache {cache} needs {total / 1e9:.2f} GB for the versions in use, over its "
                        f"limit of {limit / 1e9:.2f} GB; raise the limit (--cache-gb) or use a bigger --cache-dir")
    return removed


def push_back(store: str | Path, local: Path, storage_options: dict[str, Any] | None = None):
    """After a writer committed into the cached copy `local` of the store URL `store`: push what it added (the
    push's summary; None for a local store)."""
    if not is_url(store):
        return None
    from store.remote_sync import push

    return push(local, str(store).rstrip("/"), storage_options)
