"""`pipeline store push|pull`: copy a store's committed versions between a local folder and a URL.

The remote holds the local layout unchanged (`store.json`, `<table>/v<N>/<file>`), so what makes a version
visible is the same on both sides: its `manifest.parquet`. An object store has no rename, but a PUT is atomic
(an object is there whole or not at all), so the commit order is the commit:
- push writes its lease object (store/remote_lease.py) before it lists the remote, uploads each version's data
  objects (schema, shards, indexes, rank-done files), then `checksums.json`, checks the version's objects are all
  there (one listing: a gc may have taken a killed push's leftovers meanwhile), then `manifest.parquet` LAST,
  and rewrites the remote `store.json` only after every version is complete (never to an older current version
  than the remote's): a reader of the remote never sees a version whose files are not all there. A rerun after
  a failure lists the remote once and skips every object already there with the same size and CRC32C (recorded
  as object metadata at upload; the values are those of the version's `checksums.json`), so it sends only the
  rest.
- pull downloads into `<table>/.v<N>.pull/` (not a version name: readers ignore it), checks every file's CRC32C
  against the version's sealed `checksums.json` as it arrives (a damaged object is refused, naming it), fetches
  the manifest last and renames the folder to `v<N>` - the local commit, exactly as a writer's. A rerun keeps the
  files already fetched and checked.
Versions are immutable, so "what the other side lacks" is a version without a manifest there; the same version
number with a different manifest is a conflict (two stores that grew apart), refused rather than overwritten.
Only the store's own files are copied: complete versions not marked damaged, `store.json`, and the rows of
`quarantine.parquet` (merged: the other side's rows plus those it lacks, so the rejections of every stage and every
node add up; on the remote by compare-and-swap); never temp files, locks, leases, or incomplete versions.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from schemas.errors import UserError
from schemas.newer import refuse_newer
from schemas.temp_files import temp_of
from store import format as fmt
from store import integrity, remote_checked, remote_endpoint, remote_lease
from store.checksum import SealError, crc_hex, seal, unseal
from store.io_errors import describe, is_not_writable
from store.remote import Remote, SharedBar, each_at_once, lost_object, lost_version, open_remote, remote_errors
from store.lease import process_tag, warn_damaged
from store.remote_shards import is_cache_file, is_lazy
from store.remote_upload import Mismatch

PULL_SUFFIX = ".pull"
log = logging.getLogger("store")
_MANIFEST_RE = re.compile(r"([^/]+)/v(\d+)/" + re.escape(fmt.MANIFEST))


def marker_rel(table: str, version: int) -> str:
    """Where `store repair` marks a version damaged (store/format.damaged_marker), relative to the store root."""
    return fmt.damaged_marker(Path("."), table, version).as_posix()


def newer_version(newer: list[str], table: str) -> int | None:
    """`table`'s version in a list of "table/vN" names kept current over a pushed or adopted one (None: not there):
    what `_merged_record(newer=)` fills."""
    for name in newer:
        t, v = name.rsplit("/v", 1)
        if t == table:
            return int(v)
    return None


@dataclass
class SyncSummary:
    direction: str  # "push" | "pull"
    url: str
    copied: list[str] = field(default_factory=list)  # "table/vN" made complete on the destination
    present: list[str] = field(default_factory=list)  # already complete there
    objects_sent: int = 0
    objects_skipped: int = 0  # already there with the same size and CRC32C (a rerun)
    bytes_sent: int = 0
    damaged: list[str] = field(default_factory=list)  # objects kept although they differ (pull for repair)
    newer: list[str] = field(default_factory=list)  # push: "table/vN" the remote had current, above the pushed one
    set_aside: list[str] = field(default_factory=list)  # push for repair: a damaged remote file, kept under this name
    # "table/vN" not sent (push) or not copied (a pull of a whole URL): the source's gc would remove it (store/gc.py
    # `not_kept`, store/remote_gc.py `not_kept`)
    garbage: list[str] = field(default_factory=list)

    def newer_current(self, table: str) -> int | None:
        """The remote's current version of `table` that this push kept over the pushed one (None: none)."""
        return newer_version(self.newer, table)

    def sent(self, f: "_File") -> None:
        self.objects_sent += 1
        self.bytes_sent += f.nbytes

    def __str__(self) -> str:
        what = ", ".join(self.copied) or "nothing new"
        return (f"{self.direction} {self.url}: copied {what}; {len(self.present)} version(s) already there; "
                f"{self.objects_sent} file(s), {self.bytes_sent / 2**20:.1f} MiB "
                f"{'sent' if self.direction == 'push' else 'fetched'}, {self.objects_skipped} "
                "already there" + (f"; kept the remote's newer current {', '.join(self.newer)}" if self.newer else "")
                + "".join(f"; {fmt.QUARANTINE} (damaged) set aside as {name}" for name in self.set_aside)
                + "".join(f"\nnot {'sent' if self.direction == 'push' else 'copied'} {name}: not current in its store (replaced by a newer current version, or "
                          "switched away from), read under no live lease, and no kept version was made from it: "
                          "garbage, which `pipeline store gc` removes" for name in self.garbage))


@dataclass
class _File:
    rel: str  # path relative to the store root ("vae/v1/shard-r00-000000.tar")
    nbytes: int
    crc: str
    cached: bool = False  # a cache's copy sent again (`_lost_held_here`): evicted meanwhile, it is not sent


def _ordered(table: str, version: int, files: dict[str, dict[str, Any]], record: bytes) -> list[_File]:
    """A version's files in commit order: data, then checksums.json, then manifest.parquet last."""
    base = f"{table}/v{version}/"
    data = [_File(base + n, int(e["nbytes"]), e["crc32c"]) for n, e in sorted(files.items()) if n != fmt.MANIFEST]
    manifest = files[fmt.MANIFEST]
    return data + [_File(base + fmt.CHECKSUMS, len(record), crc_hex(record)),
                   _File(base + fmt.MANIFEST, int(manifest["nbytes"]), manifest["crc32c"])]


def version_files(record: bytes, where: str) -> dict[str, dict[str, Any]]:
    """The `files` of a version's sealed checksums.json (`record`, read from `where`): damaged, of a newer
    release, or without the manifest: one line."""
    return version_record(record, where)["files"]


def version_record(record: bytes, where: str) -> dict[str, Any]:
    """A version's whole sealed checksums.json (`files`, and `counts` where recorded), checked as `version_files`
    checks it."""
    try:
        obj = unseal(record)
    except SealError as e:
        fix = f"delete {where} (objects are never overwritten) and push" if "://" in where else "push"
        raise UserError(f"{where} is damaged ({e}); {fix} its version again from an intact store, or run "
                        "`pipeline store verify` on the store it came from") from None
    refuse_newer(where, obj, integrity.CHECKSUMS_FORMAT, intact=True)  # its files are not this code's to copy
    files = obj.get("files") or {}
    if fmt.MANIFEST not in files:
        raise UserError(f"{where} does not list {fmt.MANIFEST}; the version cannot be checked")
    return {**obj, "files": files}


def _local_versions(root: Path, tables: dict[str, dict]) -> list[tuple[str, int]]:
    """Complete, undamaged versions of every table the local store names (`tables`: its store.json's)."""
    return [(t, v) for t in sorted(tables) for v in fmt.list_versions(root, t)
            if fmt.is_complete(fmt.version_dir(root, t, v)) and not fmt.damaged_marker(root, t, v).exists()]


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, dynamic_ncols=True)


def _conflict(table: str, version: int, url: str, local: Path, remote: Remote | None = None) -> UserError:
    if remote is not None and not remote.fs.exists(remote.path(f"{table}/v{version}/{fmt.MANIFEST}")):
        if pushes := _other_pushes(remote, table, version):
            return UserError(f"{table} v{version} at {url} is being pushed right now, with other contents than "
                             f"{local}'s, by {'; '.join(pushes)}: two different stores pushed into one prefix at "
                             f"once, and that version is the other push's; push {local} into an empty prefix "
                             "instead")
        return UserError(f"{table} v{version} at {url} is an incomplete version with other contents than "
                         f"{local}'s (objects of a push that was killed before its manifest, from another store); "
                         f"`pipeline store gc {url}` removes it once it is an hour old and no push holds it, then "
                         "push again")
    if (Path(local) / "source-url.txt").is_file():  # a cache of this URL (store/remote_cache.py): stale
        return UserError(f"{table} v{version} differs between the cache {local} and {url} (another writer committed "
                         f"v{version} there first, or the remote was rebuilt since: a deleted prefix, a restarted "
                         f"in-memory server); remove {local} (a cache) and rerun")
    return UserError(f"{table} v{version} differs between {local} and {url} (a different manifest under the same "
                     "version number: the stores grew apart); push/pull into an empty prefix or folder instead")


def _other_pushes(remote: Remote, table: str, version: int) -> list[str]:
    """The live push leases of other processes naming `table` v`version` (its objects theirs, in flight)."""
    import socket

    listing = remote.listing_times(remote_lease.LEASES_DIR)  # the leases only, not the whole prefix
    return [f.describe() for f in remote_lease.leases(remote, listing)
            if f.live and f.record.get("kind") == "push" and (table, version) in set(f.versions())
            and (f.record.get("pid"), f.record.get("host")) != (os.getpid(), socket.gethostname())]


# ---------------------------------------------------------------- push


def push(src: Path, url: str, storage_options: dict[str, Any] | None = None,
         replacing: dict[str, int] | None = None, set_aside_quarantine: bool = False) -> SyncSummary:
    """Every complete local version the remote lacks, then store.json. `replacing` ({table: version}, repair and
    migrate on a URL): only those tables' current versions change, and only if the remote's still are those
    versions (checked inside store.json's compare-and-swap): a writer that advanced one meanwhile is not undone.
    `set_aside_quarantine` (repair): a damaged remote quarantine.parquet is set aside, not refused."""
    src = Path(src)
    if not (src / fmt.STORE_JSON).is_file():
        raise UserError(f"no store at {src} (no {fmt.STORE_JSON}); pass the store folder a stage wrote")
    local_rec = fmt.read_store_record(src)
    remote = open_remote(url, storage_options)
    summary = SyncSummary("push", url)
    with remote_errors(url, "push"):
        versions = _local_versions(src, local_rec["tables"])
        # lazily cached versions came from this remote (their manifests are there): nothing of them is sent
        pushing = [(t, v) for t, v in versions if not is_lazy(fmt.version_dir(src, t, v))]
        # The push lease first, naming every version this push may write, before it lists what is there: a gc
        # from then on keeps those versions' objects (the leftovers of a killed push this one resumes included).
        lease = remote_lease.hold(remote, pushing, "push", kind="push") if pushing else None
        try:
            # the listing only when there is something to send: a stage of `run all` found up to date pushes its
            # cached copy back, and a whole prefix (~200k objects at 1M samples) was listed for nothing
            listing = remote.listing() if pushing else None
            remote_record(remote, listing)  # a newer format (or a damaged record): refused
            todo, files_of = _plan_push(remote, src, url, listing, versions, summary, local_rec["tables"])
            if not set_aside_quarantine:  # refused before any upload, not after the versions are there
                check_quarantine(remote, src)
            _upload(remote, src, url, todo, files_of, summary)
            push_quarantine(remote, src, set_aside_quarantine, summary.set_aside)
            # store.json last: the remote's current versions become the local ones (those complete there now)
            there = {tuple(name.rsplit("/v", 1)) for name in summary.copied + summary.present}
            current = {t: e for t, e in local_rec["tables"].items() if (t, str(e["current"])) in there}
            if replacing is not None:
                current = {t: e for t, e in current.items() if t in replacing}
            # a version this store switched away from is garbage at the URL too (its gc's tell, `was_current`)
            left = {t: {v for v in fmt.was_current(e) if (t, str(v)) in there} for t, e in current.items()}
            remote.swap(fmt.STORE_JSON, lambda old: _changed(old, _merged_record(old, current, url, replacing,
                                                                            summary.newer, left)))
        finally:  # held until the new versions are current: till then gc would count them unreferenced
            if lease is not None:
                lease.release()
    return summary


def _plan_push(remote: Remote, src: Path, url: str, listing: dict[str, int] | None,
               versions: list[tuple[str, int]], summary: SyncSummary, entries: dict[str, dict]
               ) -> tuple[list[_File], dict[str, list[_File]]]:
    """What to send (objects not there with the same size and CRC32C), and each copied version's files.
    `listing` None: nothing to send (every version lazily cached), the prefix was not listed. A version the store's
    own gc would remove (`not_kept`: replaced by a newer current one or switched away from, leased by no reader,
    made nothing kept) is not sent (`summary.garbage`) unless its manifest is there already: such a one is checked
    and refilled as before (a switched-away one the URL's record takes for switched away from too). `entries`: the
    local store.json's tables, as push read them."""
    from store.gc import not_kept

    garbage, damaged = not_kept(src, entries)  # (empty while a local lease is damaged: each named in one line)
    warn_damaged(src, damaged, f"every complete version is pushed to {url}, those this store's gc would remove too")
    todo: list[_File] = []
    files_of: dict[str, list[_File]] = {}
    for table, version in versions:
        vdir = fmt.version_dir(src, table, version)
        if is_lazy(vdir):  # a cached copy of a version of this very remote (store/remote_shards.py)
            manifest_rel = f"{table}/v{version}/{fmt.MANIFEST}"
            if not (manifest_rel in listing if listing is not None else remote.exists(manifest_rel)):
                # its shards are not here to send
                raise UserError(f"{table} v{version} is cached in {src} but is no longer at {url} (the remote lost "
                                f"it: a deleted prefix, a restarted in-memory server); the cache holds only its "
                                f"metadata: remove {src} (a cache) and rerun, to rebuild it on the remote")
            summary.present.append(f"{table}/v{version}")
            if listing is not None:
                todo += _lost_held_here(remote, src, table, version, listing)
            continue
        if not (vdir / fmt.CHECKSUMS).is_file():
            raise UserError(f"{vdir} has no {fmt.CHECKSUMS} (store format 1): push copies only versions it "
                            "can verify; rebuild the table with this version of the pipeline")
        record = (vdir / fmt.CHECKSUMS).read_bytes()
        files = _ordered(table, version, version_files(record, str(vdir / fmt.CHECKSUMS)), record)
        manifest = files[-1]
        if manifest.rel not in listing and (table, version) in garbage:  # (one there: as before, below)
            summary.garbage.append(f"{table}/v{version}")
            continue
        if manifest.rel in listing:
            if not _same(remote, listing, manifest):
                raise _conflict(table, version, url, src)
            summary.present.append(f"{table}/v{version}")
            # objects of the committed version deleted behind the tool's back (pull, inspect and the readers say
            # to push the version again from an intact store): sent again, from the listing made anyway
            todo += [f for f in files[:-1] if f.rel not in listing]
            continue
        summary.copied.append(f"{table}/v{version}")
        files_of[manifest.rel] = files
    # A resumed push: each object listed with the right size costs a HEAD (its recorded CRC32C), two per shard
    # (~40k for a 1M-sample table); one after the other, the latency was the whole cost.
    candidates = [f for files in files_of.values() for f in files]
    for f, there in zip(candidates, each_at_once(lambda f: _same(remote, listing, f), candidates)):
        if there:
            summary.objects_skipped += 1
        else:
            todo.append(f)
    return todo, files_of


def _lost_held_here(remote: Remote, src: Path, table: str, version: int, listing: dict[str, int]) -> list[_File]:
    """The objects of a lazily cached version of the URL (fetched from it, or pushed from here and marked) that the
    push's listing lacks and the cache holds intact (its metadata always, a shard once fetched whole): deleted
    there behind the tool's back, where readers are told to push that version again. Sent again, as a local
    store's are (`_plan_push`), from the listing push makes anyway: a local listing of the folder; only when
    something is missing, its checksums.json read and one request for the manifest's CRC32C (nothing is sent into
    another store's version of that number). One the cache lacks, or holds damaged (this node's disk), stays lost:
    `pipeline store verify URL` names it."""
    from store.checksum import file_crc

    vdir = fmt.version_dir(src, table, version)
    base = f"{table}/v{version}/"
    try:
        gone = {name for name in os.listdir(vdir) if base + name not in listing and not is_cache_file(name)}
        record = (vdir / fmt.CHECKSUMS).read_bytes() if gone else b""
    except FileNotFoundError:  # evicted whole since it was listed (another process's open): nothing held to send
        return []
    if not gone:
        return []
    files = _ordered(table, version, version_files(record, str(vdir / fmt.CHECKSUMS)), record)
    if not _same(remote, listing, files[-1]):  # the URL's version of that number is not this one
        return []
    held = []
    for f in files[:-1]:  # (the manifest is there)
        try:
            if f.rel[len(base):] in gone and file_crc(src / f.rel) == (f.crc, f.nbytes):
                held.append(_File(f.rel, f.nbytes, f.crc, cached=True))
        except FileNotFoundError:  # evicted since the folder's listing (another process's fetch made room)
            continue
    return held


def _upload(remote: Remote, src: Path, url: str, todo: list[_File], files_of: dict[str, list[_File]],
            summary: SyncSummary) -> None:
    with _progress(sum(f.nbytes for f in todo), f"push {url}") as progress:
        bar, batch = SharedBar(progress), []

        def send_batch() -> None:  # several at a time: only a manifest's order matters
            for f in each_at_once(lambda f: _send(remote, src, url, f, bar), batch):
                if f is not None:
                    summary.sent(f)
            batch.clear()

        for f in todo:
            if f.rel not in files_of:
                batch.append(f)
                continue
            send_batch()  # a manifest: the commit of its version, once every other object of it is there
            _refill(remote, src, url, files_of[f.rel], bar, summary)
            fmt.crash_point("push_before_manifest")
            summary.sent(_send(remote, src, url, f, bar))
        send_batch()


def _send(remote: Remote, src: Path, url: str, f: _File, bar) -> _File | None:
    """`f` uploaded (checked against its record as it is read); None for a cache's copy evicted meanwhile."""
    path = src / f.rel
    if f.cached and not path.is_file():
        return None
    if not path.is_file():
        raise UserError(f"{path} is missing (listed in its version's {fmt.CHECKSUMS}); run "
                        f"`pipeline store verify` / `pipeline store repair` on the store, then push again")
    try:  # never spread damage: the bytes sent are checked against the record (one read), before they are visible
        created = remote.upload(path, f.rel, f.crc, bar, f.nbytes)
    except Mismatch as e:
        raise UserError(f"{path} is damaged ({e}; recorded {f.nbytes} bytes, crc32c {f.crc}): not sent; run "
                        "`pipeline store repair` on the store, then push again") from None
    except FileNotFoundError:
        if f.cached and not path.exists():  # evicted while it was read
            return None
        raise
    # objects are write-once: one that appeared since the listing must be this very file
    if not created and not remote.has(f.rel, f.nbytes, f.crc):
        table, version = f.rel.split("/")[:2]
        raise _conflict(table, int(version[1:]), url, src, remote)
    return f


def _refill(remote: Remote, src: Path, url: str, files: list[_File], bar, summary: SyncSummary) -> None:
    """Right before a version's manifest, one listing of the version: every other object must be there. A gc
    that judged the leftovers of a killed push stale before this push's lease existed may have removed objects
    this push skipped as present; they are sent again, so the manifest never commits an incomplete version."""
    base = files[-1].rel.rsplit("/", 1)[0]
    there = remote.listing(base)
    for f in files[:-1]:
        if there.get(f.rel) != f.nbytes:
            summary.sent(_send(remote, src, url, f, bar))


def damaged_quarantine(url: str, why: str) -> UserError:
    return UserError(f"{url}/{fmt.QUARANTINE} is damaged ({why}); run `pipeline store repair {url}` (it sets the "
                     "file aside), then rerun")


def check_quarantine(remote: Remote, src: Path) -> None:
    """Before a commit that `push_quarantine` follows: a damaged remote `quarantine.parquet` that would refuse
    `src`'s rows is refused now, in one line, while nothing is committed yet (not after the version is)."""
    from store import quarantine

    if not (src / fmt.QUARANTINE).is_file():
        return  # nothing to merge: push_quarantine does not read the remote file
    try:
        data = remote.read(fmt.QUARANTINE)
    except FileNotFoundError:
        return
    rows, why = quarantine.parsed(data)
    if rows is None:
        raise damaged_quarantine(remote.url, why)


def push_quarantine(remote: Remote, src: Path, set_aside: bool = False, aside: list[str] | None = None) -> int:
    """Add the local quarantine rows the remote's `quarantine.parquet` lacks (every stage, every node adds rows: a
    merge, by compare-and-swap, so no node's rows are lost); how many were new. A damaged remote file is refused
    (one line), or with `set_aside` (`store repair URL`) kept as `quarantine.parquet.damaged-<crc>` and replaced
    by the local rows, as repair sets a local one aside (its name appended to `aside`)."""
    from store import quarantine

    if not (src / fmt.QUARANTINE).is_file() and not set_aside:
        return 0
    mine = quarantine.read(src)  # a damaged local file: one line naming it
    added = [0]

    def update(old: bytes | None) -> bytes | None:
        rows, why = (None, "") if old is None else quarantine.parsed(old)
        if old is not None and rows is None:
            if not set_aside:
                raise damaged_quarantine(remote.url, why)
            name = f"{fmt.QUARANTINE}.damaged-{crc_hex(old)}"  # named by its content: a retry rewrites the same
            remote.write(name, old)
            if aside is not None and name not in aside:
                aside.append(name)
        merged, added[0] = quarantine.merged_rows(rows, mine)
        return fmt.parquet_bytes(merged) if added[0] or (old is not None and rows is None) else None

    remote.swap(fmt.QUARANTINE, update, attempts=64)  # every node of a job may merge at once
    return added[0]


def pull_quarantine(remote: Remote, dst: Path, damaged_ok: bool = False) -> int:
    """Add the remote's quarantine rows the local copy lacks; how many were new. A damaged remote file is refused
    in one line; with `damaged_ok` (repair's working copy) its bytes are copied as they are when the copy has no
    quarantine file yet, for repair's scan to find and set aside."""
    from store import quarantine

    try:
        data = remote.read(fmt.QUARANTINE)
    except FileNotFoundError:
        return 0
    rows, why = quarantine.parsed(data)
    if rows is None:
        if not damaged_ok:
            raise damaged_quarantine(remote.url, why)
        if not (dst / fmt.QUARANTINE).exists():
            fmt.atomic_write_bytes(dst / fmt.QUARANTINE, data)
        return 0
    return quarantine.merge_into(dst, rows)


def _merged_record(old: bytes | None, current: dict[str, Any], url: str,
                   replacing: dict[str, int] | None = None, newer: list[str] | None = None,
                   left: dict[str, set[int]] | None = None) -> bytes:
    """The remote's store.json with `current` made current - except over a higher version number (committed there
    by another writer since this store last saw it: a push never rolls the remote back; listed in `newer`).
    `left`: per table, the pushed versions the pushing store switched away from (its `was_current`)."""
    rec = fmt.new_store_record() if old is None else _parse_record(old, url)
    if newer is not None:
        newer.clear()  # this is called again on every compare-and-swap attempt
    current = dict(current)
    for table, entry in list(current.items()):
        now = (rec["tables"].get(table) or {}).get("current")
        if replacing is None and now is not None and int(now) > int(entry["current"]):
            del current[table]
            if newer is not None:
                newer.append(f"{table}/v{now}")
    for table, v in (replacing or {}).items():
        now = (rec["tables"].get(table) or {}).get("current")
        new = current.get(table, {}).get("current")
        if now is not None and int(now) != v and (new is None or int(now) != int(new)):  # new: a rerun's again
            raise UserError(f"{url}: table '{table}' became v{now} while this command replaced v{v}; its new "
                            f"version is uploaded but not made current: rerun the command on the new state")
    # each entry from the remote's own (`was_current`: what was current there), and of the pushing store's record
    # only the versions it pushed and switched away from: taken for never current, the URL's gc kept them
    current = {t: fmt.table_entry(rec["tables"].get(t), int(e["current"]), also=(left or {}).get(t, set()))
               for t, e in current.items()}
    return seal({**rec, "tables": {**rec["tables"], **current}, "format_version": fmt.STORE_FORMAT_VERSION})


def _changed(old: bytes | None, new: bytes) -> bytes | None:
    """`new`, or None (no write) when it is what is there: a push that changed nothing rewrites nothing."""
    return None if new == old else new


def _parse_record(data: bytes, url: str) -> dict[str, Any]:
    where = f"{url}/{fmt.STORE_JSON}"
    try:
        rec = unseal(data)
    except SealError as e:
        if (line := remote_endpoint.not_s3(url)) is not None:  # the HTML page read as its bytes
            raise UserError(line) from None
        raise UserError(f"{where} is damaged ({e}); push the store again into an empty prefix") from None
    fmt.check_store_record(rec, where)
    return rec


def _same(remote: Remote, listing: dict[str, int], f: _File) -> bool:
    """Is the object there already with this file's size and CRC32C?"""
    return remote.has(f.rel, f.nbytes, f.crc, listing)


def remote_record(remote: Remote, listing: dict[str, int] | None) -> dict[str, Any] | None:
    """The remote's store.json (None when there is none); `listing` None: not listed, read to find out."""
    if listing is not None and fmt.STORE_JSON not in listing:
        return None
    try:
        return _parse_record(remote.read(fmt.STORE_JSON), remote.url)
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------- pull


def damaged_object(url: str, f: _File, nbytes: int, crc: str) -> UserError:
    """A fetched object whose bytes are not what its version's checksums.json records: refused, in one line."""
    return UserError(f"{url}/{f.rel} is damaged ({nbytes} bytes, crc32c {crc}; its version's {fmt.CHECKSUMS} "
                     f"records {f.nbytes} bytes, crc32c {f.crc}); refused: delete {url}/{f.rel} (objects are "
                     "never overwritten) and push that version again from an intact store")


def wanted_versions(rec: dict[str, Any] | None, url: str, tables: list[str] | None, optional: tuple[str, ...],
                    listing: dict[str, int] | None) -> tuple[dict[str, Any], list[str] | None, set[tuple[str, int]]]:
    """What a pull or a cache open of `url` takes: (its store record, the tables asked for that it has, the
    versions): `tables`' current versions (those in `optional` may be missing; an empty prefix when all are), or
    with `tables=None` every complete version in `listing` that `store repair` did not retire."""
    if rec is None and tables is not None and set(tables) <= set(optional):
        rec = fmt.new_store_record()  # an empty prefix, of which nothing is needed: a store's first writer
    if rec is None:
        raise UserError(remote_endpoint.not_s3(url) or f"no store at {url} (no {fmt.STORE_JSON} there); check the "
                        "URL, or push a store first")
    if tables is None:
        listing = listing or {}
        return rec, None, {(m.group(1), int(m.group(2))) for rel in listing if (m := _MANIFEST_RE.fullmatch(rel))
                           and marker_rel(m.group(1), int(m.group(2))) not in listing}
    tables = [t for t in tables if t in rec["tables"] or t not in optional]
    missing = sorted(set(tables) - set(rec["tables"]))
    if missing:
        raise UserError(f"no table {', '.join(missing)} in the store at {url} (tables: "
                        f"{sorted(rec['tables']) or 'none'}); run the stage that writes it and push again")
    return rec, tables, {(t, int(rec["tables"][t]["current"])) for t in tables}


def pull(url: str, dst: Path, storage_options: dict[str, Any] | None = None,
         tables: list[str] | None = None, optional: tuple[str, ...] = (), damaged_ok: bool = False,
         every_version: bool = False, record: dict[str, Any] | None = None) -> SyncSummary:
    """Every complete remote version the local store lacks that the URL's gc keeps (store/remote_gc.py
    `not_kept`: one replaced by a newer current version or switched away from, read under no live lease and made
    nothing kept, is not copied: `summary.garbage`); with `tables`, only those tables' current versions (what a
    reader opening them needs: store/remote_cache.py), of which those in `optional` may be missing.
    Versions that `store repair` replaced (a `<table>/v<N>.damaged.json` marker on the remote) are not copied.
    `damaged_ok` (repair's working copy, store/remote_work.py): an object that does not match its checksums is
    kept as it is, for repair to find, and named in the summary's `damaged`, instead of refused; a version marked
    damaged in `dst` (a killed repair replaced it there already) is not pulled again. `every_version` (repair's
    working copy, which looks at every version there): those the URL's gc would remove are copied too. `record`:
    the URL's store.json as the caller read it already (store/remote_work.py), not fetched again (nor by the
    URL's `not_kept`)."""
    from store.remote_gc import not_kept, read_once
    from store.store import Store

    dst = Path(dst)
    remote = open_remote(url, storage_options)
    summary = SyncSummary("pull", url)
    with remote_errors(url, "pull"), _writing_into(dst, url):
        if tables is not None and _all_cached(remote, dst, tables, summary, damaged_ok, record):
            return summary
        whole = tables is None and not every_version  # then what the URL's gc would remove is not copied
        listing, times = _listing(remote, whole)
        rec = record if record is not None else remote_record(remote, listing)
        rec, tables, wanted = wanted_versions(rec, url, tables, optional, listing)
        # (complete versions the URL's gc would remove, one rule with gc and push: not copied, `summary.garbage`;
        # those a pull names, `tables`' current ones, always are)
        # (`read`: each version's checksums.json the keep rule read - megabytes at 1M samples - not read again to
        # copy it; versions never change under their number, and each object copied is checked against it)
        read = read_once(remote)
        garbage, damaged = not_kept(remote, times, rec["tables"], read) if whole else (set(), [])
        warn_damaged(url, damaged, "every complete version is pulled, those the URL's gc would remove too")
        _refuse_lost_current(remote, rec, tables, listing)
        store = Store(dst)
        versions = _versions_to_pull(listing, tables, wanted, dst, damaged_ok)
        # (a copy of one here already is checked and refilled as before)
        skipped = [(t, v) for t, v in versions if (t, v) in garbage and not fmt.version_dir(dst, t, v).exists()]
        summary.garbage = [f"{t}/v{v}" for t, v in skipped]
        versions = [tv for tv in versions if tv not in skipped]
        lease = _hold_pulling(remote, versions, dst)
        try:
            _pull_versions(remote, dst, versions, summary, damaged_ok, read)
        finally:  # held till every version is copied: a gc meanwhile keeps them
            if lease is not None:
                lease.release()
        if fmt.QUARANTINE in listing:
            pull_quarantine(remote, dst, damaged_ok)
        for table, entry in sorted(rec["tables"].items()):
            if tables is not None and table not in tables:
                continue
            if fmt.is_complete(fmt.version_dir(dst, table, int(entry["current"]))):
                # a copy of a version the URL switched away from is garbage here too (the local gc's tell)
                left = {v for v in fmt.was_current(entry) if fmt.is_complete(fmt.version_dir(dst, table, v))}
                store.set_current(table, int(entry["current"]), also=left)
    return summary


@contextmanager
def _writing_into(dst: Path, url: str) -> Iterator[None]:
    """A pull's write refused in `dst` (a read-only mount: EROFS; another account's folder: EACCES) as one line
    naming the file and what to do (store/io_errors.py's, as every write's). Errors
    naming no path in `dst` pass: the URL's (S3's access denied names none; a file:// URL's own path), and a full
    disk (its callers' lines: the CLI's, the cache's)."""
    try:
        yield
    except OSError as e:
        name = e.filename
        if not is_not_writable(e) or name is None or not Path(os.path.abspath(os.fsdecode(name))).is_relative_to(
                os.path.abspath(dst)):
            raise
        err = describe(e, f"the pull of {url} into {dst}", dst)  # (its not-writable line)
        if err is None:
            raise
        raise err from None


def _listing(remote: Remote, whole: bool) -> tuple[dict[str, int], dict[str, tuple[int, float]] | None]:
    """The URL's listing ({rel: size}) and, for a pull of the whole URL (`whole`), its times too (the URL's gc
    judges versions by them: store/remote_gc.py `not_kept`)."""
    if not whole:
        return remote.listing(), None
    times = remote.listing_times()
    return {rel: size for rel, (size, _) in times.items()}, times


def _versions_to_pull(listing: dict[str, int], tables: list[str] | None, wanted: set[tuple[str, int]], dst: Path,
                      damaged_ok: bool) -> list[tuple[str, int]]:
    """The complete versions of the listing a pull copies (or refills): those of `wanted` when `tables` is given,
    never one `store repair` retired, nor - repair's working copy - one a killed repair replaced in `dst` already."""
    out = []
    for rel in sorted(listing):
        m = _MANIFEST_RE.fullmatch(rel)
        if not m:
            continue
        table, version = m.group(1), int(m.group(2))
        if tables is not None and (table, version) not in wanted:
            continue
        if marker_rel(table, version) in listing:
            continue
        if damaged_ok and fmt.damaged_marker(dst, table, version).exists():  # replaced here by a killed repair
            continue
        out.append((table, version))
    return out


def _hold_pulling(remote: Remote, versions: list[tuple[str, int]], dst: Path) -> remote_lease.RemoteLease | None:
    """A read lease naming the versions a pull copies, as every reader of a URL holds one: a `store gc` elsewhere
    during a pull of hours removed those no longer current from under it (the pull stopped at the first object
    gone, and its rerun found the version no more). Written before their manifests are looked at again, as
    store/remote_lease.hold_reading does: one a gc deleted before it could see the lease is refused. None with
    nothing to copy, or with credentials that may not write (warned; the pull goes on without). Lost (the process
    paused past its margin), it stops reads of `dst` only."""
    if not versions:
        return None
    try:
        lease = remote_lease.hold(remote, versions, "store pull", scope=str(dst))
    except PermissionError as e:
        log.warning("%s: no read lease (%s); a `store gc` meanwhile could remove versions this pull copies",
                    remote.url, e)
        return None
    if gone := [f"{t} v{v}" for t, v in versions if not remote.exists(f"{t}/v{v}/{fmt.MANIFEST}")]:
        lease.release()
        raise UserError(f"{remote.url}: {gone[0]} was removed (by `store gc`) while this pull listed it; rerun to "
                        "copy what is there now")
    return lease


def _pull_versions(remote: Remote, dst: Path, versions: list[tuple[str, int]], summary: SyncSummary,
                   damaged_ok: bool, read: Callable[[str], bytes] | None = None) -> None:
    """Each version into `dst`: a copy there already is checked to be the same and refilled, the others fetched.
    `read`: the URL's objects as the caller's keep rule read them already (store/remote_gc.py `read_once`)."""
    url = remote.url
    plan: list[tuple[str, int, bytes, list[_File]]] = []
    for table, version in versions:
        record = _read_checksums(remote, table, version, read)
        files = _ordered(table, version, version_files(record, f"{url}/{table}/v{version}/{fmt.CHECKSUMS}"),
                         record)
        vdir = fmt.version_dir(dst, table, version)
        if vdir.exists():
            if not _same_version(vdir, record, files):
                raise _conflict(table, version, url, dst)
            # repair's working copy keeps what it pulled as it is, for its scan; a version it holds lazily
            # (opened as an older one by a killed run, current since) is completed all the same
            if not damaged_ok or is_lazy(vdir):
                refill(remote, dst, table, version, files, summary, damaged_ok)
            summary.present.append(f"{table}/v{version}")
            continue
        plan.append((table, version, record, files))
    total = sum(f.nbytes for *_, files in plan for f in files)
    with _progress(total, f"pull {url}") as bar:
        for table, version, record, files in plan:
            _pull_version(remote, dst, table, version, files, bar, summary, damaged_ok)
            summary.copied.append(f"{table}/v{version}")


def _refuse_lost_current(remote: Remote, rec: dict[str, Any], tables: list[str] | None,
                         listing: dict[str, int]) -> None:
    """A current version (of `tables`, or of every table) without its manifest in the listing: lost on the remote
    (`lost_version`), or changed since the listing (a rerun sees it). Before, pull copied nothing of it and reported
    success ("copied nothing new")."""
    for t in sorted(rec["tables"] if tables is None else tables):
        v = int(rec["tables"][t]["current"])
        if f"{t}/v{v}/{fmt.MANIFEST}" in listing or marker_rel(t, v) in listing:
            continue
        raise lost_version(remote, t, v) or UserError(f"pull {remote.url}: {t} v{v} changed while it was listed (a "
                                                      "push or gc meanwhile); rerun")


def _all_cached(remote: Remote, dst: Path, tables: list[str], summary: SyncSummary, damaged_ok: bool,
                rec: dict[str, Any] | None = None) -> bool:
    """A reader's warm open: are the current versions of `tables` all in `dst` already? Then one GET of store.json
    (none when the caller read it: `rec`) and one of each version's checksums.json (a version that differs is
    refused) replace the listing of the whole prefix (thousands of objects for a large store); False sends the
    caller the full way."""
    from store.store import Store

    if not (dst / fmt.STORE_JSON).is_file():
        return False
    if rec is None and (rec := remote_record(remote, None)) is None:
        return False
    if not set(tables) <= set(rec["tables"]):
        return False
    wanted = [(t, int(rec["tables"][t]["current"])) for t in tables]
    if not all(fmt.is_complete(fmt.version_dir(dst, t, v)) for t, v in wanted):
        return False
    for t, v in wanted:
        where = f"{remote.url}/{t}/v{v}/{fmt.CHECKSUMS}"
        record = _read_checksums(remote, t, v)
        files = _ordered(t, v, version_files(record, where), record)
        if not _same_version(fmt.version_dir(dst, t, v), record, files):
            raise _conflict(t, v, remote.url, dst)
        if not damaged_ok or is_lazy(fmt.version_dir(dst, t, v)):  # as `pull` below
            refill(remote, dst, t, v, files, summary, damaged_ok)
        summary.present.append(f"{t}/v{v}")
    store = Store(dst)
    for t, v in wanted:
        store.set_current(t, v)
    return True


def _same_version(vdir: Path, record: bytes, files: list[_File]) -> bool:
    """Is the local `vdir` a copy of the remote version whose sealed checksums.json is `record`? Its own
    checksums.json is that record byte for byte (then any other difference is damage to this copy: refilled), or
    its manifest has the remote's CRC32C (a copy whose checksums.json was lost); else it is another store's."""
    try:
        if (vdir / fmt.CHECKSUMS).read_bytes() == record:
            return True
    except OSError:
        pass
    return fmt.is_complete(vdir) and remote_checked.known_crc(vdir / fmt.MANIFEST)[0] == files[-1].crc


def stale_files(vdir: Path, files: list[_File]) -> list[_File]:
    """The files of the local copy `vdir` that are missing or not their recorded size: one stat each (~20k for a
    1M-sample version), no read. A lazily cached version's shards not fetched yet are missing too: a pull takes
    the version whole (a whole open of the cache, repair's and migrate's working copy)."""
    out = []
    for f in files:
        try:
            size = os.stat(vdir / f.rel.rsplit("/", 1)[1]).st_size
        except FileNotFoundError:
            out.append(f)
            continue
        if size != f.nbytes:
            out.append(f)
    return out


def refill(remote: Remote, dst: Path, table: str, version: int, files: list[_File], summary: SyncSummary,
           damaged_ok: bool = False) -> None:
    """Fetch again the files of a local copy of a version that were deleted or cut short since (a user's rm, a full
    disk, a killed copy), and the shards of a lazily cached copy not fetched yet: found by `stale_files`, each
    checked as it streams to a temp name and renamed into place (never a partial file under the name), the manifest
    last; then the damage the readers recorded for them (`v<N>.damaged.json`) is cleared, so the repaired copy reads
    without a stale report. `damaged_ok` (repair's working copy): an object that fails its check is kept as it is
    for repair's scan, its damage record too."""
    from store.remote_shards import FETCH_TAG, is_shard

    vdir = fmt.version_dir(dst, table, version)
    stale = stale_files(vdir, files)
    if not stale:
        return
    lazy = is_lazy(vdir)
    # a lazily cached version's shards not fetched yet are expected there, not damage: no warning for those
    broken = [f for f in stale if not (lazy and is_shard(f.rel.rsplit("/", 1)[1])
                                       and not (vdir / f.rel.rsplit("/", 1)[1]).exists())]
    if broken:
        log.warning("%s: %d file(s) of %s v%d missing or of the wrong size (%s); fetching them again from %s",
                    vdir, len(broken), table, version, ", ".join(f.rel.rsplit("/", 1)[1] for f in broken[:5])
                    + (" ..." if len(broken) > 5 else ""), remote.url)
    intact: list[str] = []
    with _progress(sum(f.nbytes for f in stale), f"refill {table} v{version}") as bar:
        bar = SharedBar(bar)

        def fetch(f: _File) -> str:
            path = vdir / f.rel.rsplit("/", 1)[1]
            # in a cache, named as a shard fetch's temp file: a killed one's is removed by the next open there
            # (store/remote_cache._remove_dead_fetches), where `.NAME.tmp-PID` stayed, counted against its limit
            part = (path.with_name(f".{path.name}{FETCH_TAG}{process_tag()}-{threading.get_ident()}") if lazy
                    else temp_of(path))
            return fetch_checked(remote, f, path, bar, damaged_ok, part=part)

        def done(f: _File, how: str) -> None:
            if how == "damaged":
                summary.damaged.append(f.rel)
            else:
                intact.append(f.rel.rsplit("/", 1)[1])
            summary.sent(f)

        manifest = [f for f in stale if f.rel.endswith("/" + fmt.MANIFEST)]
        rest = [f for f in stale if f not in manifest]
        for f, how in zip(rest, each_at_once(fetch, rest)):
            done(f, how)
        for f in manifest:  # last, as a commit: the version is complete again only with every file back
            done(f, fetch(f))
    fmt.fsync_dir(vdir)
    integrity.clear_damage(vdir, intact)


def fetch_checked(remote: Remote, f: _File, path: Path, bar, damaged_ok: bool = False,
                  part: Path | None = None) -> str:
    """One object into `path`, its size and CRC32C checked while it streams to `part` (default `NAME.part`) and
    renamed into place: never a partial file under the name. 'skipped' when `path` holds it already (an earlier
    run), 'sent', or - a difference with `damaged_ok` (pull for repair) - 'damaged', kept; any other difference
    raises. A file an earlier run fetched is trusted unread while its size and mtime are those recorded when it was
    checked (store/remote_checked.py), else read again."""
    if path.is_file() and remote_checked.known_crc(path) == (f.crc, f.nbytes):
        bar.update(f.nbytes)
        return "skipped"
    part = part if part is not None else path.with_name(path.name + ".part")
    try:
        crc = remote.download(f.rel, part, bar)
    except FileNotFoundError as e:
        part.unlink(missing_ok=True)
        return _missing_object(remote, f, e, damaged_ok)
    except BaseException:  # a full disk, a lost connection: no partial file is left behind
        part.unlink(missing_ok=True)
        raise
    size = part.stat().st_size
    if (size, crc) != (f.nbytes, f.crc) and not damaged_ok:
        part.unlink()
        raise damaged_object(remote.url, f, size, crc)
    if (size, crc) == (f.nbytes, f.crc):
        remote_checked.record(part, crc)  # before the rename: a name never carries a record of other bytes
    os.replace(part, path)
    return "sent" if (size, crc) == (f.nbytes, f.crc) else "damaged"


def _read_checksums(remote: Remote, table: str, version: int, read: Callable[[str], bytes] | None = None) -> bytes:
    """A version's checksums.json (through `read`, `remote.read` by default); one gone while its manifest is still
    there (or with its whole version, which store.json names current) is lost, not removed by a gc meanwhile (gc
    deletes the manifest first, of versions no longer current): named in one line (`lost_object`), where "rerun"
    would fail the same way for ever."""
    rel = f"{table}/v{version}/{fmt.CHECKSUMS}"
    try:
        return (read or remote.read)(rel)
    except FileNotFoundError as e:
        lost = lost_object(remote, rel, e)
        if lost is None:  # the bucket gone, or the version with a gc: remote_errors says rerun
            raise
    raise lost


def _missing_object(remote: Remote, f: _File, e: FileNotFoundError, damaged_ok: bool) -> str:
    """An object its version's checksums.json lists is not there (`remote.lost_object`); repair's pull
    (`damaged_ok`) leaves a lost one missing for the scan to find ('damaged')."""
    lost = lost_object(remote, f.rel, e)
    if lost is None:
        raise e  # the bucket or the whole version went away meanwhile (a gc): remote_errors says rerun
    if damaged_ok:
        return "damaged"
    raise lost


def _pull_version(remote: Remote, dst: Path, table: str, version: int, files: list[_File], bar,
                  summary: SyncSummary, damaged_ok: bool = False) -> None:
    """Fetch one version into its pull folder, every file checked (several at a time); the rename is the commit."""
    final = fmt.version_dir(dst, table, version)
    tmp = final.with_name(f".{final.name}{PULL_SUFFIX}")
    tmp.mkdir(parents=True, exist_ok=True)
    bar = SharedBar(bar)

    def fetch(f: _File) -> str:
        return fetch_checked(remote, f, dst / f.rel.replace(f"{table}/v{version}/", f"{table}/{tmp.name}/", 1), bar,
                             damaged_ok)

    for f, how in zip(files, each_at_once(fetch, files)):  # several at a time: the rename below is the commit
        if how == "skipped":
            summary.objects_skipped += 1
            continue
        if how == "damaged":
            summary.damaged.append(f.rel)
        summary.sent(f)
    for p in tmp.iterdir():
        fmt.fsync_dir(p)  # os.fsync on a descriptor of the file
    fmt.fsync_dir(tmp)
    os.rename(tmp, final)
    fmt.fsync_dir(final.parent)
