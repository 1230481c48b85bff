"""What `pipeline store push` (store/remote_push.py) and `pipeline store pull` (store/remote_pull.py) share: a
version's files in commit order, its sealed `checksums.json` and the URL's `store.json` read and checked, the
refusal of a version that differs between the two sides, and the summary both return.

The remote holds the local layout unchanged (`store.json`, `<table>/v<N>/<file>`), so what makes a version
visible is the same on both sides: its `manifest.parquet`. An object store has no rename, but a PUT is atomic
(an object is there whole or not at all), so the commit order is the commit: push uploads a version's manifest
last, pull fetches a version into a folder that is not a version name and renames it into place.
Versions are immutable, so "what the other side lacks" is a version without a manifest there; the same version
number with a different manifest is a conflict (two stores that grew apart), refused rather than overwritten.
Only the store's own files are copied: complete versions not marked damaged, `store.json`, and the rows of
`quarantine.parquet` (merged: the other side's rows plus those it lacks, so the rejections of every stage and every
node add up; on the remote by compare-and-swap); never temp files, locks, leases, or incomplete versions.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.errors import UserError
from schemas.newer import refuse_newer
from schemas.units import size_text
from store import format as fmt
from store import integrity, remote_endpoint, remote_lease
from store.checksum import SealError, crc_hex, unseal
from store.remote import Remote
from store.remote_parts import SOURCE_URL

_MANIFEST_RE = re.compile(r"([^/]+)/v(\d+)/" + re.escape(fmt.MANIFEST))


def marker_rel(table: str, version: int) -> str:
    """Where `store repair` marks a version damaged (store/format.damaged_marker), relative to the store root."""
    return fmt.damaged_marker(Path("."), table, version).as_posix()


def newer_version(newer: list[str], table: str) -> int | None:
    """`table`'s version in a list of "table/vN" names kept current over a pushed or adopted one (None: not there):
    what store/remote_push.py `_merged_record(newer=)` fills."""
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
                f"{self.objects_sent} file(s), {size_text(self.bytes_sent)} "
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
    cached: bool = False  # a cache's copy sent again (remote_push `_lost_held_here`): evicted meanwhile, it is not sent


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


def _conflict(table: str, version: int, url: str, local: Path, remote: Remote | None = None) -> UserError:
    # asked of the server (a HEAD): an earlier listing of the version in this process, kept by s3fs, lacks a
    # manifest written since and would name a complete version incomplete
    if remote is not None and not remote.exists(f"{table}/v{version}/{fmt.MANIFEST}"):
        if pushes := _other_pushes(remote, table, version):
            return UserError(f"{table} v{version} at {url} is being pushed right now, with other contents than "
                             f"{local}'s, by {'; '.join(pushes)}: two different stores pushed into one prefix at "
                             f"once, and that version is the other push's; push {local} into an empty prefix "
                             "instead")
        return UserError(f"{table} v{version} at {url} is an incomplete version with other contents than "
                         f"{local}'s (objects of a push that was killed before its manifest, from another store); "
                         f"`pipeline store gc {url}` removes it once it is an hour old and no push holds it, then "
                         "push again")
    if (Path(local) / SOURCE_URL).is_file():  # a cache of this URL (store/remote_cache.py): stale
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


def damaged_quarantine(url: str, why: str) -> UserError:
    return UserError(f"{url}/{fmt.QUARANTINE} is damaged ({why}); run `pipeline store repair {url}` (it sets the "
                     "file aside), then rerun")


def _parse_record(data: bytes, url: str) -> dict[str, Any]:
    where = f"{url}/{fmt.STORE_JSON}"
    try:
        rec = unseal(data)
    except SealError as e:
        if (line := remote_endpoint.not_s3(url)) is not None:  # the HTML page read as its bytes
            raise UserError(line) from None
        raise UserError(f"{where} is damaged ({e}); run `pipeline store repair {url}` (rebuilt from the versions "
                        "there)") from None
    fmt.check_store_record(rec, where)
    return rec


def remote_record(remote: Remote, listing: dict[str, int] | None) -> dict[str, Any] | None:
    """The remote's store.json (None when there is none); `listing` None: not listed, read to find out."""
    if listing is not None and fmt.STORE_JSON not in listing:
        return None
    try:
        return _parse_record(remote.read(fmt.STORE_JSON, small=True), remote.url)
    except FileNotFoundError:
        return None
