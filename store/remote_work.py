"""`store repair URL` and `migrate v1-to-v2 URL`: the local command on a working copy, then push's commit.

The working copy is `<cache dir>/.work/<hash of the URL>/` (beside the readers' cache, not in it: a dot folder
holds no store.json, so cache eviction never touches it, and a reader never sees a version repair is still
writing). It holds each table's current version whole - what repair scans and recomputes from, and what migrate
rewrites - pulled with every object checked; for repair, an object that fails its check is kept as it is
(`damaged_ok`), for repair's scan to find. Every other complete remote version is there as a lazily cached copy
(its metadata only, store/remote_shards.py): new version numbers are then chosen above every one the remote has,
and push skips such copies. Where that open fails (an older version's metadata damaged), every version is pulled
whole, as before: at terabytes the difference is the non-current versions' shards never crossing the network. The local command then runs there with all its guarantees (writer
locks, manifest-last commit, verify before set-aside), and `publish` pushes the result back with push's protocol:
write-once objects, each version's manifest last, store.json by compare-and-swap. So a killed repair/migrate
leaves nothing visible on the remote; a rerun pulls nothing new and resumes in the working copy; two of them
racing for the same new version number cannot both commit (the manifest is a conditional PUT).

What repair records locally (`v<N>.damaged.json`, the damaged folder set aside) is mirrored on the remote after
the new version is current: the marker object `<table>/v<N>.damaged.json` (pull and verify skip a marked
version), then the old version's manifest is deleted - unless a live lease object names it (a reader still on
it): then it stays until `store gc URL` finds it unheld. The working copy is removed once published.

A command holds a flock on `<hash>.lock` beside its working copy for its whole run (`working_copy`). A copy a
killed run left is removed by `store gc URL --cache-dir D` (`collect_work`) once no command holds it and the
URL's store has moved on from it (judged against `work-base.json`, the URL's current versions when the copy was
begun), or on `--drop-work`: without that, nothing removed it, and it can hold whole table versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from schemas.errors import UserError
from schemas.units import size_text
from store import format as fmt
from store import remote_lease
from store.remote import open_remote, remote_errors
from store.remote_cache import default_cache_dir, recount
from store.remote_parts import SOURCE_URL

WORK_DIR = ".work"
BASE = "work-base.json"  # {table: the URL's current version} when the copy was begun


def work_root(url: str, cache_dir: str | Path | None) -> Path:
    """This node's working copy of `url`: `<cache dir>/.work/<hash of the URL>/`."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cache / WORK_DIR / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def lock_of(root: Path) -> Path:
    """The flock a repair/migrate holds on its working copy for its whole run, beside it (not in it: `store gc URL`
    removes the folder while it holds the lock)."""
    return root.with_name(root.name + ".lock")


@contextmanager
def working_copy(url: str, cache_dir: str | Path | None, damaged_ok: bool = False,
                 storage_options: dict[str, Any] | None = None) -> Iterator[Path]:
    """`work_copy`, its flock held until the command is done: `store gc URL` never removes a live one, and a
    second repair/migrate of the URL on this node is refused with one line instead of writing into it too."""
    url = url.rstrip("/")
    root = work_root(url, cache_dir)
    root.parent.mkdir(parents=True, exist_ok=True)
    with fmt.flock(lock_of(root), blocking=False, holder=f"the working copy {root} of {url}"):
        try:
            yield work_copy(url, cache_dir, damaged_ok, storage_options)
        finally:
            if not root.exists():  # published (or nothing to do): no lock file left behind per URL
                lock_of(root).unlink(missing_ok=True)


def work_copy(url: str, cache_dir: str | Path | None, damaged_ok: bool = False,
              storage_options: dict[str, Any] | None = None) -> Path:
    from store.remote_shards import open_lazily
    from store.remote_pull import pull

    url = url.rstrip("/")
    root = work_root(url, cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    # which URL, and its current versions when the copy was begun, before anything is pulled (a pull killed half-way
    # leaves most of the bytes): `store gc URL` names the URL and tells a copy the URL's store has moved on from
    (root / SOURCE_URL).write_text(url + "\n")
    record = _record_at(url, storage_options)
    tables = None if record is None else sorted(record["tables"])
    if record is not None and not (root / BASE).is_file():  # a rerun resuming keeps the first run's
        fmt.atomic_write_json(root / BASE, {t: int(e["current"]) for t, e in record["tables"].items()})
    pull(url, root, storage_options, tables=tables, damaged_ok=damaged_ok, record=record)
    if tables is not None:
        try:
            # not a version a killed repair replaced here already (it awaits its retirement on the remote)
            open_lazily(url, root, storage_options, None, skip=lambda t, v: fmt.damaged_marker(root, t, v).exists(),
                        damaged_ok=damaged_ok)
        except UserError:  # (DamagedData too) an older version's metadata damaged (or its manifest pulled damaged)
            pull(url, root, storage_options, damaged_ok=damaged_ok, every_version=True)
    recount(root.parent.parent)  # whole versions just landed in the cache folder: its limited readers count them
    return root


def _record_at(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any] | None:
    """The remote's store.json; None without one (pull then says so)."""
    from store.remote_sync import remote_record

    with remote_errors(url, "open"):
        return remote_record(open_remote(url, storage_options), None)


def replaced_here(root: Path) -> list[tuple[str, int]]:
    """The versions repair replaced in the working copy, this run or a killed earlier one: marked damaged and set
    aside (no longer a version there); the remote has yet to retire them."""
    out = []
    for marker in sorted(root.glob("*/v*.damaged.json")):
        table, v = marker.parent.name, int(marker.name.split(".")[0][1:])
        if not fmt.is_complete(fmt.version_dir(root, table, v)):
            out.append((table, v))
    return out


def publish(url: str, root: Path, replaced: list[tuple[str, int]], echo: Callable[[str], None] = print,
            storage_options: dict[str, Any] | None = None, damaged: bool = True) -> None:
    """Push the working copy's new versions, made current only where the remote's current versions are still
    the `replaced` ones (store.json's compare-and-swap); then, for repair (`damaged`), retire the replaced ones."""
    from store.remote_push import push
    from store.remote_sync import marker_rel

    url = url.rstrip("/")
    echo(str(push(root, url, storage_options, replacing=dict(replaced), set_aside_quarantine=damaged)))
    if not damaged:
        shutil.rmtree(root, ignore_errors=True)
        return
    remote = open_remote(url, storage_options)
    with remote_errors(url, "repair"):
        for table, v in replaced:
            fmt.crash_point("repair_before_retire")
            marker = fmt.damaged_marker(root, table, v)
            if marker.is_file():
                remote.write(marker_rel(table, v), marker.read_bytes())
            listing = remote.listing_times(remote_lease.LEASES_DIR)  # the leases only, not the whole prefix
            readers = [f.describe() for f in remote_lease.leases(remote, listing)
                       if f.live and (table, v) in set(f.versions())]
            if readers:
                echo(f"{url}: the damaged {table} v{v} is still read by {'; '.join(readers)}: left in place (not "
                     f"current, marked damaged); `pipeline store gc {url}` removes it once no reader holds it")
                continue
            remote.delete([f"{table}/v{v}/{fmt.MANIFEST}"])  # the version stops existing; gc takes the rest
            echo(f"{url}: the damaged {table} v{v} was retired (marked damaged, its manifest deleted; "
                 f"`pipeline store gc {url}` removes its other objects)")
    shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- `store gc URL`: this node's dead working copy


@dataclass
class LeftCopy:
    root: Path
    nbytes: int  # what removing it frees (a file hard-linked outside it frees nothing)
    held_by: str | None  # the live repair/migrate holding its lock, or None
    moved_on: str | None  # how the URL's store moved on from it; None: a rerun would resume in it


def left_copy(url: str, cache_dir: str | Path | None,
              storage_options: dict[str, Any] | None = None) -> LeftCopy | None:
    """This node's working copy of `url`, if one is there, judged: held by a live command (its flock), or left by
    a killed one - and then whether the URL's store has moved on from it (a table's current version there is
    neither the one the copy was begun from nor one the killed run published itself), so its rerun could
    publish nothing. A copy begun by an earlier release (no record of its start) is not judged moved on."""
    root = work_root(url, cache_dir)
    if not root.is_dir():
        return None
    held_by = fmt.lock_holder(lock_of(root))  # a live repair/migrate
    moved_on = None if held_by else _moved_on(url.rstrip("/"), root, storage_options)
    return LeftCopy(root, _whole_bytes(root), held_by, moved_on)


def _moved_on(url: str, root: Path, storage_options: dict[str, Any] | None) -> str | None:
    try:
        base = {t: int(v) for t, v in json.loads((root / BASE).read_text()).items()}
    except (OSError, ValueError, AttributeError):
        base = None
    record = _record_at(url, storage_options)
    if record is None:
        return f"{url} holds no store any more (no store.json)"
    for table, begun in sorted((base or {}).items()):
        entry = record["tables"].get(table)
        now = None if entry is None else int(entry["current"])
        if now is None or now == begun:
            continue
        if not _published_from(url, root, table, now, storage_options):
            return f"{table} v{now} is current there; the copy was begun from {table} v{begun}"
        # the copy's own version (pushed by the killed run, or the same one another repair pushed): left to do
        # only the retirement of what it replaced, unless that is marked there already
        left = [v for t, v in replaced_here(root) if t == table and not _marked(url, table, v, storage_options)]
        if not left:
            return f"its {table} v{now} is current there already"
    return None


def _marked(url: str, table: str, version: int, storage_options: dict[str, Any] | None) -> bool:
    from store.remote_sync import marker_rel

    with remote_errors(url, "gc"):
        try:
            open_remote(url, storage_options).read(marker_rel(table, version), small=True)
            return True
        except FileNotFoundError:
            return False


def _published_from(url: str, root: Path, table: str, version: int,
                     storage_options: dict[str, Any] | None) -> bool:
    """Is the URL's `table` v`version` the copy's own (the killed run pushed it): the same checksums.json."""
    vdir = fmt.version_dir(root, table, version)
    if not fmt.is_complete(vdir):
        return False
    with remote_errors(url, "gc"):
        try:
            there = open_remote(url, storage_options).read(f"{table}/v{version}/{fmt.CHECKSUMS}", small=True)
        except FileNotFoundError:
            return False
    return (vdir / fmt.CHECKSUMS).read_bytes() == there


def _whole_bytes(folder: Path) -> int:
    """The bytes removing `folder` frees: each file once (repair links carried shards between versions), and
    only one whose every link is inside."""
    seen: dict[tuple[int, int], list[int]] = {}  # (dev, inode) -> [size, links, links found inside]
    for dirpath, _, names in os.walk(folder):
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            seen.setdefault((st.st_dev, st.st_ino), [st.st_size, st.st_nlink, 0])[2] += 1
    return sum(size for size, links, inside in seen.values() if inside >= links)


def collect_work(url: str, cache_dir: str | Path | None, dry_run: bool = False, drop: bool = False,
                 echo: Callable[[str], None] = print, storage_options: dict[str, Any] | None = None) -> int:
    """`store gc URL`'s look at this node's working copy of `url` (`--cache-dir`): removed when a killed
    repair/migrate left it and the URL's store has moved on from it, or `drop` (`--drop-work`); kept while a
    command holds it. One line either way, naming the URL, the folder and the bytes. Returns the bytes freed."""
    from store.gc import DELETING_SUFFIX

    url = url.rstrip("/")
    root = work_root(url, cache_dir)
    doomed = root.with_name(f".{root.name}{DELETING_SUFFIX}")
    if doomed.is_dir():  # a gc killed while it removed one
        echo(f"{'would finish' if dry_run else 'finish'} removing {doomed} (the working copy of {url}: an "
             "interrupted gc)")
        if not dry_run:
            shutil.rmtree(doomed)
    left = left_copy(url, cache_dir, storage_options)
    if left is None:
        return 0
    what = f"the working copy {left.root} of {url}"
    size = size_text(left.nbytes)
    if left.held_by:
        echo(f"keep {what} ({size}): a store repair / migrate of it is running ({left.held_by})")
        return 0
    if left.moved_on is None and not drop:
        echo(f"keep {what} ({size}): left by a killed store repair / migrate, and the store there has not moved "
             f"on, so its rerun resumes there; add --drop-work to remove it")
        return 0
    why = f"the store there has moved on: {left.moved_on}" if left.moved_on else "--drop-work"
    echo(f"{'would remove' if dry_run else 'remove'} {what} (left by a killed store repair / migrate; {why}; "
         f"{size}{' would be' if dry_run else ''} freed)")
    if dry_run:
        return 0
    try:
        with fmt.flock(lock_of(root), blocking=False, holder=what):
            os.rename(root, doomed)  # the commit: a repair starting from here on begins a fresh copy
            lock_of(root).unlink(missing_ok=True)
    except UserError:  # a repair/migrate of the URL started since the look: its copy now
        echo(f"keep {what}: a store repair / migrate of it started meanwhile")
        return 0
    shutil.rmtree(doomed)
    return left.nbytes
