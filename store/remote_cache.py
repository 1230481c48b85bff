"""A store at a URL read through a bounded local cache: each version's metadata on open, shard bytes on need.

`local_store(url, tables, cache_dir, limit_gb)` makes `cache_dir/<hash of url>/` a local store holding the
current versions of `tables` lazily (store/remote_shards.py: store.json, schema, manifest, shard indexes, each
checked against the version's sealed checksums.json; a shard is fetched - whole for a scan, by byte range for a
random read - when a reader first needs it), and the reader then opens it as any other. Versions are immutable, so
a cached version never goes stale; a newer current version on the remote is opened beside it on the next open.
The cache stays under its size limit by evicting least recently used shard files (`make_room`, before every whole
fetch, so also during a long read; it walks the cache only when the node's running total `USAGE` nears the limit)
and, on open, whole versions nobody uses (`evict`): only copies of the remote's, never a version a writer committed
here and has not pushed (the only copy of that work until its rerun pushes it). Processes of one node share the
cache: opens, evictions and space reservations run under one lock on the cache folder; a shard unlinked while
another process has it open stays readable there (POSIX), and its next miss fetches it again; a version a live
reader holds a read lease on (store/lease.py, written by train's reader inside the cached store) is never evicted
whole, and the metadata of the versions in use never at all; while a live lease is damaged (which versions it names
cannot be told), no version of its store is, said once in one line (an open or a read goes on: `store gc`, asked
for, stops there). Eviction removes the lease files of dead readers it meets (judged and removed as `store gc` does,
store/lease.remove_dead: one its reader refreshed meanwhile is kept, and its version with it; an open without a
limit, which evicts nothing, those of the store it opens) and, first, the temp files of killed fetches (named by
pid, start time and pid namespace: containers sharing the cache folder have their own pids, so another namespace's
is judged by its age, store/lease.tag_gone); every open, with a limit or without, removes those of the store it
opens by the same rule, over the limit or not.

A writer (the encoders) works on the cached copy and then pushes it back (`push_back`): the remote commit keeps
push's guarantees (write-once objects, manifest last, store.json by compare-and-swap), so a killed encoder leaves
nothing visible on the remote and a rerun resumes from the cached copy's committed shards. Once pushed, its
versions are marked as copies of the remote's (their shards, and the versions whole, become evictable, refetched
on need).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from schemas.errors import UserError
from schemas.units import size_text
from store import format as fmt
from store import lease as leases
from store.io_errors import CACHE_FULL, writing
from store.remote import is_url

log = logging.getLogger("store")


def default_cache_dir() -> Path:
    # beside the file-hash cache (models/file_hashes.py): $XDG_CACHE_HOME when set, as the XDG convention says
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qwen-edit-pipeline" / "stores"

CACHE_LOCK = ".cache.lock"
EVICTING = ".evicting"
# The node's running total of the cache's bytes, `{"bytes": N}`, read and written only under CACHE_LOCK: a walk
# (every file of every cached version, ~20k at 1M samples) before each whole-shard fetch made a run O(shards^2).
# A walk sets it exactly; each fetch's reservation adds to it, and only a fetch that would take it near the limit
# walks (and evicts). A file on the node's disk, not a per-process count: the ranks of a node fill one cache.
USAGE = ".cache.usage"
WALK_FREES = 8  # a walk frees 1/8 of the limit beyond the fetch: the next walk comes that many fetched bytes later
# Files that grow outside fetches are counted by walks only: the range counts (8 bytes a range read, dropped once
# the shard is fetched whole) and a writer's shards in its cached copy. A walk once the total is within 1/64.
NEAR = 64


def local_store(store: str | Path, tables: list[str] | None, cache_dir: str | Path | None = None,
                limit_gb: float | None = None, storage_options: dict[str, Any] | None = None,
                optional: tuple[str, ...] = (), *, whole: bool = False, lease: bool = True) -> Path:
    """`store` itself when it is a local folder; for a URL, the cached local store holding `tables`' current
    versions (those in `optional` only when the remote has them), lazily: metadata now, shards when read.
    `tables=None`: every complete version the remote holds. `whole=True`: pull
    the versions entirely now (every file checked, as `pipeline store pull`; a version cached lazily before gets its
    missing shards): opened lazily, then every missing shard fetched as a reader's scan fetches it (`fetch_all`),
    without holding the cache lock through the download. `lease`: a lease object on the
    remote names the versions read, till this process exits (store/remote_lease.py)."""
    if not is_url(store):
        return Path(store)
    from store import remote_shards

    url = str(store).rstrip("/")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    root = cache / hashlib.sha256(url.encode()).hexdigest()[:16]
    limit = None if limit_gb is None else int(limit_gb * 1e9)
    remote_shards.set_limit(cache, limit)  # this process's shard fetches keep the cache under it
    with fmt.flock(cache / CACHE_LOCK), writing("the store cache", cache, instead=CACHE_FULL):
        needed = remote_shards.open_lazily(url, root, storage_options, tables, optional)
        pulling = _hold_while_pulling(root, needed) if whole else None
        if pulling is None:
            _opened(url, root, cache, limit, needed, storage_options)
    if pulling is not None:
        # The shards without the cache lock, which the node's other readers need to fetch and open meanwhile (a
        # whole pull held it for hours): each fetch takes it only to reserve its bytes. A lease file pins the
        # versions against another open's eviction of whole versions meanwhile (as a reader's lease does).
        try:
            remote_shards.fetch_all(root, needed)
            _refill_unmarked(url, root, needed, storage_options, cache)
        except BaseException:
            pulling.release()
            raise
        with fmt.flock(cache / CACHE_LOCK), writing("the store cache", cache, instead=CACHE_FULL):
            pulling.release()  # under the lock, the versions in the walk's `keep`: its file not in the total it sets
            _opened(url, root, cache, limit, needed, storage_options)
    if lease:  # a lease object on the remote naming what this process reads, till it exits (store/remote_lease.py)
        from store.remote_lease import hold_reading

        hold_reading(url, sorted(needed), storage_options, root=root)
    return root


def _opened(url: str, root: Path, cache: Path, limit: int | None, needed: set[tuple[str, int]],
            storage_options: dict[str, Any] | None) -> None:
    """What an open does last, under the cache lock: the versions' last use, the temp files of killed fetches and
    the lease files of killed readers removed, the limit kept (or, without one, the running total dropped)."""
    from store import remote_shards
    from store.remote_parts import SOURCE_URL

    # which remote this cached store copies: for a human, and store/remote_parts.py finds the URL here (before the
    # walk below: its bytes in the running total it sets)
    (root / SOURCE_URL).write_text(url + "\n")
    for t, v in needed:
        os.utime(fmt.version_dir(root, t, v))  # last use, for LRU
    # eviction removes them only when over the limit (without one, never): one per killed fetch piled up
    _remove_dead_fetches(root)
    if limit is not None:
        remote_shards.mark_copies(url, root, storage_options)  # evictable whole; never a version not pushed
        evict(cache, limit, {(root, t, v) for t, v in needed})
    else:  # what this open fetched is in no total: a limited process of the node walks before its next fetch
        (cache / USAGE).unlink(missing_ok=True)
        # no eviction walk removes the lease files of this store's killed readers (one per kill -9, thousands at
        # scale): judged here as eviction judges them, one folder, the opened store's
        _live_leases(root)


def _hold_while_pulling(root: Path, versions: set[tuple[str, int]]) -> leases.Lease:
    """A read lease on the cached store `root` naming `versions` (taken under the cache lock, right after they were
    opened): no eviction removes them whole while a whole open fetches their shards without the lock."""
    held = leases.hold(root, {}, "store pull")
    for t, v in sorted(versions):
        held.add(t, v)
    return held


def _refill_unmarked(url: str, root: Path, versions: set[tuple[str, int]], storage_options: dict[str, Any] | None,
                     cache: Path) -> None:
    """The files missing from the versions of `versions` held whole here, not lazily (pulled whole by earlier
    releases, or committed here and pushed by a push_back killed before it marked them): fetched again, each
    checked, as `pipeline store pull` refills a local copy (under the cache lock: such a copy is counted by walks
    only, `recount`)."""
    from store.remote_shards import is_lazy
    from store.remote_pull import pull

    unmarked = [t for t, v in sorted(versions) if not is_lazy(fmt.version_dir(root, t, v))]
    if unmarked:
        with fmt.flock(cache / CACHE_LOCK), writing("the store cache", cache, instead=CACHE_FULL):
            pull(url, root, storage_options, tables=sorted(set(unmarked)))
            (cache / USAGE).unlink(missing_ok=True)


def open_beside(root: Path, table: str, version: int) -> None:
    """A complete version of the remote besides the current ones the cached store `root` was opened with (a rerun
    adopting an older version of its settings: store/remote_parts.open_committed), lazily, under the cache lock as
    `local_store` opens. This process's read lease names it first: a `store gc` keeps it until it is made current,
    and one that removed it since the caller listed it is reported."""
    from store import remote_shards
    from store.remote_lease import hold_reading
    from store.remote_parts import source_url

    url, cache = source_url(root), root.parent
    assert url is not None, f"{root} is no store URL's cache"
    hold_reading(url, [(table, version)], root=root)
    with fmt.flock(cache / CACHE_LOCK), writing("the store cache", cache, instead=CACHE_FULL):
        remote_shards.open_version(url, root, table, version)
        os.utime(fmt.version_dir(root, table, version))  # last use, for LRU
        (cache / USAGE).unlink(missing_ok=True)  # its metadata is in no running total: the next fetch walks


def _stat(p: Path) -> os.stat_result | None:
    """None for a file gone since it was listed (another process renames its fetched shards into place and
    unlinks its temp files without the cache lock)."""
    try:
        return p.stat()
    except FileNotFoundError:
        return None


def _uncounted(name: str) -> bool:
    """Lock files: a few bytes each, rewritten with the pid of whoever takes the lock next (so their size moves
    after any count: a limit met exactly was exceeded by a byte). The cache limit counts every other file."""
    return name.endswith(".lock")


def _counted(p: Path) -> os.stat_result | None:
    st = None if _uncounted(p.name) else _stat(p)
    return st if st is not None and stat.S_ISREG(st.st_mode) else None


def _files(folder: Path, recorded: dict[str, int] | None = None) -> tuple[list[tuple[str, int, float]], int]:
    """([(name, bytes, last use)] of the counted files directly in `folder`, bytes of those in `recorded`).
    `recorded`: files whose sizes are known without a stat (a lazily cached version's metadata: never evicted
    alone, so not listed). os.scandir, no Path per file: a walk runs under the cache lock before every whole-shard
    fetch, and a 1M-sample version holds ~20k files."""
    out, known = [], 0
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return out, known
    for e in entries:
        if _uncounted(e.name):
            continue
        if recorded is not None and (n := recorded.get(e.name)) is not None:
            known += n
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except FileNotFoundError:  # gone since the listing
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((e.name, st.st_size, st.st_mtime))
    return out, known


_recorded: dict[str, tuple[tuple[int, int, int], dict[str, int]]] = {}  # version folder -> (its record's id, sizes)


def _metadata_sizes(vdir: Path) -> dict[str, int]:
    """{name: bytes} of a lazily cached version's metadata (every file its checksums.json lists but the shards):
    fetched whole and checked before the version folder exists, and immutable after, so a walk needs no stat for
    its ~20k shard indexes. Kept per process, keyed by the record file's identity (`fmt.file_identity`)."""
    from store import integrity
    from store.remote_shards import is_shard

    try:
        st = os.stat(vdir / fmt.CHECKSUMS)
    except FileNotFoundError:
        return {}
    key = fmt.file_identity(st)
    got = _recorded.get(str(vdir))
    if got is None or got[0] != key:
        try:
            sums = integrity.read_version_checksums(vdir) or {}
        except integrity.DamagedData:  # the readers and verify say so; the walk stats every file instead
            return {}
        got = _recorded[str(vdir)] = (key, {n: int(e["nbytes"]) for n, e in sums.items() if not is_shard(n)})
    return got[1]


def _size(folder: Path) -> int:
    return sum(st.st_size for p in folder.rglob("*") if (st := _counted(p)) is not None)


def _candidates(cache: Path, keep: set[tuple[Path, str, int]],
                whole_versions: bool) -> tuple[int, list, list[tuple[Path, int]]]:
    """(bytes the cache holds, what may go: [(last use, bytes, path, is a whole version)], the complete versions
    committed only here: [(folder, bytes)]). A version in `keep` or under a live read lease (every version of a store
    with a live damaged one) keeps its folder and metadata; a lazily cached version's shards may always go
    (refetched on need). Only a copy of the remote's (lazily opened, or pushed: `is_lazy`) goes whole: a version a
    writer committed here and did not push (a failed or killed push_back) is the only copy of that work until the
    rerun pushes it - unless a newer version this cache committed and pushed replaced it (`_not_kept_here`): no push
    sends such a one, and the cached store's gc removes it."""
    from store.remote_shards import is_lazy, is_shard

    total, out, unpushed = 0, [], []
    for root in sorted(p for p in cache.iterdir() if p.is_dir()):
        if not (root / fmt.STORE_JSON).is_file():
            total += _size(root)
            continue
        live = _live_leases(root)
        leased, damaged = leases.live_versions(live)
        _say_kept_for_damaged(root, damaged)
        # what the cached store's gc would remove, asked once per store (its leases as read here) and only of a
        # version committed here: push never sends it, so kept as "not pushed yet" it counted against the limit
        garbage = functools.cache(functools.partial(_not_kept_here, root, live))
        total += sum(n for _, n, _ in _files(root)[0])
        for table_dir in sorted(p for p in root.iterdir() if p.is_dir()):
            if table_dir.name.startswith("."):
                total += _size(table_dir)
                continue
            versions = set(fmt.list_versions(root, table_dir.name))
            for p in table_dir.iterdir():
                if p.is_file():
                    total += (st.st_size if (st := _counted(p)) is not None else 0)
                elif not (fmt.VERSION_RE.fullmatch(p.name) and int(p.name[1:]) in versions):
                    total += _size(p)  # a pull or lazy open in progress, a version being evicted
            for v in sorted(versions):
                vdir = fmt.version_dir(root, table_dir.name, v)
                lazy = is_lazy(vdir)
                files, metadata = _files(vdir, _metadata_sizes(vdir) if lazy else None)
                n = metadata + sum(size for _, size, _ in files)
                total += n
                pinned = bool(damaged) or (root, table_dir.name, v) in keep or (table_dir.name, v) in leased
                if not lazy:
                    if fmt.is_complete(vdir) and (table_dir.name, v) in garbage():  # owed to no one
                        if whole_versions and not pinned:
                            out.append((vdir.stat().st_mtime, n, vdir, True))
                    elif fmt.is_complete(vdir):  # never a writer's version in progress, never one not pushed
                        unpushed.append((vdir, n))
                elif whole_versions and not pinned and fmt.is_complete(vdir):
                    out.append((vdir.stat().st_mtime, n, vdir, True))  # renamed only under the lock
                else:
                    out += [(used, size, vdir / name, False) for name, size, used in files if is_shard(name)]
                # the temp file of a fetch whose process was killed: first to go
                out += [(0.0, size, vdir / name, False) for name, size, used in files if _orphan_fetch(name, used)]
    return total, out, unpushed


def _not_kept_here(root: Path, found: list[leases.Found]) -> set[tuple[str, int]]:
    """The complete versions of the cached store `root` that its gc would remove (store/gc.py `not_kept`) because a
    newer version of the same table that this cache committed and pushed itself replaced it (`_pushed_here`): the
    writer here moved on, and no push sends it. Not one a newer version of another writer replaced (an open made
    the URL's current here): never sent, it is the only copy of its work, which the rerun of its settings adopts
    (store.find_version) and pushes. Not one switched away from (`was_current`) either: an open sets the cache's
    store.json to the URL's, which switches away from a version committed here and not pushed yet. Empty where this
    cannot be told (a record of a newer release, damage, a live damaged lease): every version committed here is
    then kept. `found`: its live leases, as `_live_leases` read them."""
    from store.gc import not_kept

    try:
        entries = fmt.read_store_record(root)["tables"]
        garbage = not_kept(root, entries, found)[0]  # (none while a lease is damaged: said by the caller)
        replaced = {(t, v) for t, v in garbage if t in entries and v < int(entries[t]["current"])}
    except UserError:
        return set()
    pushed = {t: [u for u in fmt.list_versions(root, t) if _pushed_here(fmt.version_dir(root, t, u))]
              for t in {t for t, _ in replaced}}
    return {(t, v) for t, v in replaced if any(u > v for u in pushed[t])}


def _pushed_here(vdir: Path) -> bool:
    """Did this cache's own push send the version (`push_back`: its marker says so)? A copy of the URL's that an
    open fetched, or one marked by an earlier release, was not: False."""
    from store.remote_shards import MARKER

    try:
        return json.loads((vdir / MARKER).read_text()).get("pushed_here") is True
    except (OSError, ValueError, AttributeError):
        return False


def _live_leases(root: Path) -> list[leases.Found]:
    """The live read leases of the cached store `root`; the files of dead ones are removed here (judged as `store gc`
    judges them: one per killed reader piled up until a gc of the cache's store). A damaged one names versions no
    one can tell (store/lease.py `live_versions`): the caller keeps every version of `root` while it is fresh, never
    stops (eviction is housekeeping; `store gc`, asked for, stops). `leases.remove_dead`: a lease its reader
    refreshed between the judgement and the removal is kept, and live here."""
    return [f for f in leases.remove_dead(root, leases.leases(root)) if f.live]


# damaged lease files named already by this process, as (path, inode): a walk runs before many fetches. A live
# reader refreshes its lease by `os.utime` (a new mtime, the same file: not said again); it rewrites it atomically
# (a new inode: a file damaged again is said again). A path seen whole, or gone, is forgotten: damaged again in
# place, or in a reused inode, it is said again.
_said_damaged: set[tuple[Path, int | None]] = set()


def _say_kept_for_damaged(root: Path, damaged: list[leases.Found]) -> None:
    """One line, once per damaged lease file and process: why no version of `root` is evicted whole meanwhile."""
    folder = Path(root) / leases.LEASES_DIR
    before = {key for key in _said_damaged if key[0].parent == folder}
    unsaid = [f for f in damaged if _lease_file(f) not in before]
    _said_damaged.difference_update(before)
    _said_damaged.update(_lease_file(f) for f in damaged)
    leases.warn_damaged(root, unsaid, "the store cache keeps every version of this store whole")


def _lease_file(found: leases.Found) -> tuple[Path, int | None]:
    return found.path, found.seen[0] if found.seen else None


def _remove_dead_fetches(root: Path) -> None:
    """Remove the temp files of killed fetches (`_orphan_fetch`) in the version folders of the cached store `root`
    (call under the cache lock). Only names with a fetch tag are stat'ed: a 1M-sample version holds ~20k files."""
    from store.remote_shards import FETCH_TAG

    for table_dir in (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for v in fmt.list_versions(root, table_dir.name):
            vdir = fmt.version_dir(root, table_dir.name, v)
            try:
                entries = [e for e in os.scandir(vdir) if FETCH_TAG in e.name]
            except FileNotFoundError:  # evicted by another process meanwhile
                continue
            for e in entries:
                try:
                    mtime = e.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:  # renamed into place or removed by its fetch meanwhile
                    continue
                if _orphan_fetch(e.name, mtime):
                    Path(e.path).unlink(missing_ok=True)


def _orphan_fetch(name: str, mtime: float) -> bool:
    """`.<shard>.fetch-<pid>-<start>-n<pid namespace>-<thread>` (or an earlier release's `<pid>-<start>-<thread>`
    or `<pid>-<thread>`) of a process no longer running, store/lease.tag_gone, the rule read leases are judged by:
    of this pid namespace (or not named), gone, ended (a zombie), or its pid reused by another process (another
    start time: after a reboot, or pids wrapped); of another namespace (a container sharing the cache folder, whose
    pids are not this one's), not written to (`mtime`) for the leases' margin."""
    from store.remote_shards import FETCH_TAG

    if FETCH_TAG not in name:
        return False
    parts = name.rsplit(FETCH_TAG, 1)[1].split("-")
    if not 2 <= len(parts) <= 4:  # `ranged`: the range counts, no process's
        return False
    return leases.tag_gone("-".join(parts[:-1]), mtime) is not None


def _evict(cache: Path, limit: int, keep: set[tuple[Path, str, int]],
           whole_versions: bool) -> tuple[int, list, list[tuple[Path, int]]]:
    total, candidates, unpushed = _candidates(cache, keep, whole_versions)
    removed = []
    for _, n, path, is_version in sorted(candidates, key=lambda x: x[0]):
        if total <= limit:
            break
        if is_version:
            # renamed first (no longer a version name: an opening reader sees it gone, never half-deleted)
            doomed = path.with_name(f".{path.name}{EVICTING}")
            os.rename(path, doomed)
            shutil.rmtree(doomed)
        else:
            path.unlink(missing_ok=True)  # a process that has it open keeps reading it (POSIX)
        total -= n
        removed.append(path)
    return total, removed, unpushed


def _read_usage(cache: Path) -> int | None:
    """The running total (under the cache lock); None when there is none or it is unreadable (torn by a killed
    process): the caller walks."""
    try:
        return int(json.loads((cache / USAGE).read_text())["bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_usage(cache: Path, total: int) -> None:
    # in place, no fsync: it is rebuilt by a walk whenever it cannot be read (a crash loses nothing else)
    (cache / USAGE).write_text(json.dumps({"bytes": int(total)}))


def limit_text(limit: int) -> str:
    """The cache's limit as shown, and as the user set it: --cache-gb counts GB of 10^9 bytes."""
    return f"{size_text(limit)} (--cache-gb {limit / 1e9:g})"


def evict(cache: Path, limit: int, keep: set[tuple[Path, str, int]]) -> list[Path]:
    """Remove least recently used shards of lazily cached versions and whole such versions not in use until the
    cache holds at most `limit` bytes (call under the cache lock). Kept: the metadata of `keep` and of versions with
    a live read lease, and versions committed here and not pushed (over the limit, with a warning: the rerun of
    their writer pushes them, and an open that refused them would stop it). UserError when the rest alone exceeds
    the limit. Sets the running total (an open walks once)."""
    total, removed, unpushed = _evict(cache, limit, keep, whole_versions=True)
    _write_usage(cache, total)
    owed = sum(n for _, n in unpushed)
    if total > limit and total - owed <= limit:
        log.warning("the store cache %s holds %s over its limit of %s: versions committed only there, never "
                    "pushed to their URL (%s); kept until the rerun of their stage pushes them",
                    cache, size_text(total - limit), limit_text(limit), ", ".join(str(p) for p, _ in unpushed))
    elif total > limit:
        raise UserError(f"the store cache {cache} needs {size_text(total - owed)} for the versions in use, over "
                        f"its limit of {limit_text(limit)}; raise the limit (--cache-gb) or use a bigger --cache-dir")
    return removed


def add_usage(cache: Path, incoming: int) -> None:
    """A whole fetch by a process without a limit (under the cache lock): counted in the running total all the
    same, when there is one; else a limited process sharing the cache took the total for the disk's and believed
    there was room (the cache grew past its limit by everything the other fetched)."""
    used = _read_usage(cache)
    if used is not None:
        _write_usage(cache, used + incoming)


def recount(cache: Path) -> None:
    """Bytes were written into the cache folder outside any fetch (repair's or migrate's working copy pulled into
    `.work/`): drop the node's running total, so that a limited process's next fetch walks (and evicts) instead of
    adding to a total that lacks them."""
    with fmt.flock(cache / CACHE_LOCK):
        (cache / USAGE).unlink(missing_ok=True)


def make_room(cache: Path, limit: int, incoming: int) -> bool:
    """Before fetching `incoming` bytes (under the cache lock): count them in the running total; when that would
    come near `limit`, walk the cache and evict least recently used shards until they fit with 1/`WALK_FREES` of
    the limit to spare. False when they cannot (the caller reads by range instead)."""
    if incoming > limit:  # no eviction makes it fit: evicting would only empty the cache (then refetched, thrashing)
        return False
    used = _read_usage(cache)
    if used is not None and used + incoming <= limit - limit // NEAR:
        _write_usage(cache, used + incoming)
        return True
    total, _, _ = _evict(cache, limit - incoming - limit // WALK_FREES, set(), whole_versions=False)
    fits = total + incoming <= limit
    _write_usage(cache, total + incoming if fits else total)
    return fits


def push_back(store: str | Path, local: Path, storage_options: dict[str, Any] | None = None):
    """After a writer committed into the cached copy `local` of the store URL `store`: push what it added (the
    push's summary; None for a local store)."""
    if not is_url(store):
        return None
    from store import remote_shards
    from store.remote_push import push

    url = str(store).rstrip("/")
    summary = push(local, url, storage_options)
    # on the remote now: the cached shards are copies, evictable and refetched (`present`: a version an earlier
    # push sent and was killed before marking, or sent by a version of this code that did not mark it)
    # `copied`: sent by this very push, so committed here: the proof that this cache's writer moved past an older
    # version it never pushed (`_not_kept_here`)
    for name in summary.copied + summary.present:
        table, version = name.rsplit("/v", 1)
        vdir = fmt.version_dir(local, table, int(version))
        if not remote_shards.is_lazy(vdir):
            remote_shards.mark(vdir, url, table, int(version), pushed_here=name in summary.copied)
    return summary
