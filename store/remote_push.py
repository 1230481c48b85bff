"""`pipeline store push`: copy a local store's committed versions to a URL (what push and pull share, and the
layout at the URL: store/remote_sync.py).

An object store has no rename, but a PUT is atomic (an object is there whole or not at all), so the commit order
is the commit: push writes its lease object (store/remote_lease.py) before it lists the remote, uploads each
version's data objects (schema, shards, indexes, rank-done files), then `checksums.json`, checks the version's
objects are all there (one listing: a gc may have taken a killed push's leftovers meanwhile), then
`manifest.parquet` LAST, and rewrites the remote `store.json` only after every version is complete (never to an
older current version than the remote's): a reader of the remote never sees a version whose files are not all
there. A rerun after a failure lists its versions at the remote once (each version's folder, never the whole
prefix) and skips every object already there with the same size and
CRC32C (recorded as object metadata at upload; the values are those of the version's `checksums.json`), so it
sends only the rest. The local rows of `quarantine.parquet` the remote's lacks are merged into it by
compare-and-swap (`push_quarantine`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from schemas.byte_bar import byte_bar
from schemas.errors import UserError
from store import format as fmt
from store import remote_lease
from store.checksum import crc_hex, seal
from store.lease import warn_damaged
from store.remote import Remote, SharedBar, each_at_once, open_remote, remote_errors
from store.remote_shards import is_cache_file, is_lazy
from store.remote_sync import (SyncSummary, _conflict, _File, _ordered, _parse_record, damaged_quarantine,
                               remote_record, version_files)
from store.remote_upload import Mismatch


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
            listing = _listing_of(remote, versions) if pushing else None
            remote_record(remote, None)  # a newer format (or a damaged record): refused
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


def _listing_of(remote: Remote, versions: list[tuple[str, int]]) -> dict[str, int]:
    """What the URL holds of these versions: one listing of each version's folder, several at a time. The whole
    prefix listed cost a request per 1000 objects of every version there - other tables', and the old versions no
    gc removed yet (~40k objects each at 1M samples) - on every push and every stage's push back."""
    listing: dict[str, int] = {}
    # as a prefix below the table's folder: the server lists `<table>/v<N>/` alone, and an empty one costs no more
    # requests (s3fs probes a folder it found empty once more, as a file)
    for part in each_at_once(lambda tv: remote.listing(tv[0], prefix=f"v{tv[1]}/"), versions):
        listing.update(part)
    return listing


def _local_versions(root: Path, tables: dict[str, dict]) -> list[tuple[str, int]]:
    """Complete, undamaged versions of every table the local store names (`tables`: its store.json's)."""
    return [(t, v) for t in sorted(tables) for v in fmt.list_versions(root, t)
            if fmt.is_complete(fmt.version_dir(root, t, v)) and not fmt.damaged_marker(root, t, v).exists()]


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
            if (damaged := _damaged_there(remote, url, src, listing, files)) is not None:
                raise damaged
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


def _damaged_there(remote: Remote, url: str, src: Path, listing: dict[str, int],
                   files: list[_File]) -> UserError | None:
    """The line for a version committed at the URL (its manifest listed) that is not the pushed store's version:
    another store's of that number (its manifest and checksums.json both other), or damaged at the URL - the
    manifest alone other (one HEAD for checksums.json), or an object listed at another size than the record (cut
    short, replaced by another tool: from the listing, no request). Push said "already there" of such a version, or
    that the stores grew apart; write-once, it never overwrites them: they are named, with the fix. None: intact."""
    manifest, record = files[-1], files[-2]
    bad = [f for f in files[:-1] if f.rel in listing and listing[f.rel] != f.nbytes]
    if not _same(remote, listing, manifest):
        if record.rel not in listing or record in bad or not _same(remote, listing, record):
            table, version = manifest.rel.split("/")[:2]
            return _conflict(table, int(version[1:]), url, src)
        bad.append(manifest)
    if not bad:
        return None
    named = ", ".join(f"{url}/{f.rel} ({listing[f.rel]} bytes, recorded {f.nbytes})" if listing[f.rel] != f.nbytes
                      else f"{url}/{f.rel} (crc32c not the recorded {f.crc})" for f in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return UserError(f"{named}{more}: damaged at the URL (not what the version's {fmt.CHECKSUMS} records); refused: "
                     "objects are never overwritten, so delete those objects, then push again (they are sent from "
                     "this store)")


def _same(remote: Remote, listing: dict[str, int], f: _File) -> bool:
    """Is the object there already with this file's size and CRC32C?"""
    return remote.has(f.rel, f.nbytes, f.crc, listing)


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
    with byte_bar(sum(f.nbytes for f in todo), f"push {url}") as progress:
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


def check_quarantine(remote: Remote, src: Path) -> None:
    """Before a commit that `push_quarantine` follows: a damaged remote `quarantine.parquet` that would refuse
    `src`'s rows is refused now, in one line, while nothing is committed yet (not after the version is)."""
    from store import quarantine

    if not (src / fmt.QUARANTINE).is_file():
        return  # nothing to merge: push_quarantine does not read the remote file
    try:
        data = remote.read(fmt.QUARANTINE, small=True)
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
        return quarantine.to_bytes(merged) if added[0] or (old is not None and rows is None) else None

    remote.swap(fmt.QUARANTINE, update, attempts=64)  # every node of a job may merge at once
    return added[0]


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
