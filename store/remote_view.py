"""What `pipeline store inspect` reads of a store at a URL: its metadata only, never a shard.

Inspect describes tables from `store.json`, each version's `schema.json` and `checksums.json` (its recorded counts:
samples, shards, bytes, splits, buckets; store/version_counts.py) and `quarantine.parquet`: a few KB per version,
where pulling the versions into the cache would move the whole store. So these files alone are fetched into a
temporary folder (checked as pull checks them: `checksums.json` by its seal, the others against it) and the local
code path describes that folder. A version's `manifest.parquet` (~140 MB at a million samples) stays at the URL
where its counts are recorded: its listed size is compared with the sealed record (a cut-short or overwritten one
is named), its bytes are `store verify`'s to check. A version sealed before the record has its manifest fetched and
counted, as before. Only complete versions (those with a manifest on the remote) are described; a push in progress
is not yet a version. A damaged version (its checksums.json's seal broken, a file not as sealed) is named as damaged
and the others described, as a local inspect does.
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from schemas.byte_bar import byte_bar
from schemas.errors import UserError
from schemas.newer import WrittenByNewer
from store import format as fmt
from store.checksum import crc_hex
from store.integrity import DamagedData
from store.remote import Remote, lost_object, open_remote, remote_errors
from store import quarantine, remote_endpoint, version_counts
from store.remote_sync import _MANIFEST_RE, version_record, damaged_quarantine, marker_rel

METADATA = (fmt.SCHEMA_JSON, fmt.MANIFEST)


@dataclass(frozen=True)
class MetadataCopy:
    root: Path  # a temporary local store folder: store.json, quarantine.parquet, each version's metadata
    # version folders (under root) whose manifest stayed at the URL: counts recorded, listed size as sealed
    manifests_at_url: frozenset[Path]
    # version folders (under root) whose metadata at the URL is damaged: the line naming the damage
    damaged: Mapping[Path, str] = field(default_factory=dict)


@contextmanager
def listed_store(url: str, storage_options: dict[str, Any] | None, what: str
                 ) -> Iterator[tuple[Remote, Path, dict[str, int]]]:
    """(the store at `url`, an empty temporary folder for its metadata, its listing), `what` naming the command in
    a lost connection's line; a URL holding no store is refused in one line."""
    url = url.rstrip("/")
    remote = open_remote(url, storage_options)
    with tempfile.TemporaryDirectory(prefix=f"store-{what}-") as tmp, remote_errors(url, what):
        listing = remote.listing()
        if fmt.STORE_JSON not in listing:
            if (line := remote_endpoint.not_s3(url)) is not None:  # an HTML page's "listing" holds nothing
                raise UserError(line)
            raise UserError(f"no store at {url} (no {fmt.STORE_JSON} there); check the URL, or push a store first")
        yield remote, Path(tmp), listing


@contextmanager
def metadata_copy(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[MetadataCopy]:
    """A temporary local store folder holding the metadata of every complete version at `url`."""
    url = url.rstrip("/")
    with listed_store(url, storage_options, "inspect") as (remote, root, listing):
        for name in (fmt.STORE_JSON, fmt.QUARANTINE):
            if name in listing:
                data = remote.read(name, small=True)
                if name == fmt.QUARANTINE and (why := quarantine.parsed(data)[1]):  # named by its URL, not tmp
                    raise damaged_quarantine(url, why)
                (root / name).write_bytes(data)
        bases = [f"{m.group(1)}/v{m.group(2)}" for rel in sorted(listing) if (m := _MANIFEST_RE.fullmatch(rel))
                 and marker_rel(m.group(1), int(m.group(2))) not in listing]  # not one retired by `store repair URL`
        # a manifest of a million samples is tens of MB (fetched only for versions without recorded counts): a bar
        # in bytes, over at most every file fetched
        at_url, damaged = set(), {}
        with byte_bar(sum(_listed(listing, base) for base in bases), f"inspect {url}: metadata") as bar:
            for base in bases:
                fetched, total = bar.n, bar.total
                try:
                    if _version_metadata(remote, url, base, root / base, bar, listing):
                        at_url.add(root / base)
                except DamagedData as e:  # one version's damage does not stop the report (store/inspect.py)
                    damaged[root / base] = str(e)
                    # its files after the damage are not fetched: its share of the total is what was (the bar
                    # stopped below 100 %)
                    bar.total = total - _listed(listing, base) + (bar.n - fetched)
                    bar.refresh()
        yield MetadataCopy(root, frozenset(at_url), damaged)


def _listed(listing: dict[str, int], base: str) -> int:
    """The listed bytes of a version's files that inspect may fetch (the bar's share of it)."""
    return sum(listing.get(f"{base}/{name}", 0) for name in (fmt.CHECKSUMS, *METADATA))


def _version_metadata(remote: Remote, url: str, base: str, vdir: Path, bar, listing: dict[str, int]) -> bool:
    """A version's checksums.json (checked by its seal) and METADATA files (against it) into `vdir`; True when its
    manifest was left at the URL (its counts recorded: only its listed size checked). DamagedData: a file of it is
    not as sealed (or the seal broken)."""
    vdir.mkdir(parents=True)
    record = _read(remote, f"{base}/{fmt.CHECKSUMS}")
    bar.update(len(record))
    try:
        sealed = version_record(record, f"{url}/{base}/{fmt.CHECKSUMS}")
    except WrittenByNewer:  # a newer release's version: never damage
        raise
    except UserError as e:
        raise DamagedData(str(e)) from None
    files = sealed["files"]
    (vdir / fmt.CHECKSUMS).write_bytes(record)
    # the same test as store/inspect.py's: a record it would not read has the manifest fetched and counted
    left = version_counts.shown(sealed.get("counts")) is not None
    if left and (listed := listing.get(f"{base}/{fmt.MANIFEST}")) != int(files[fmt.MANIFEST]["nbytes"]):
        raise _damaged(url, base, fmt.MANIFEST, f"{listed} bytes listed, {files[fmt.MANIFEST]['nbytes']} sealed")
    if left:  # not fetched: the bar's total counted it
        bar.total -= listing[f"{base}/{fmt.MANIFEST}"]
        bar.refresh()
    for name in METADATA:
        if name not in files or (left and name == fmt.MANIFEST):
            continue
        data = _read(remote, f"{base}/{name}")
        bar.update(len(data))
        if (len(data), crc_hex(data)) != (int(files[name]["nbytes"]), files[name]["crc32c"]):
            raise _damaged(url, base, name, "it does not match its version's checksums.json")
        (vdir / name).write_bytes(data)
    return left


def _read(remote: Remote, rel: str) -> bytes:
    """An object of a version; one deleted behind the tool's back (listed by its checksums.json, or a checksums.json
    beside its manifest) is that version's damage (`DamagedData`, the object named), not a "rerun" that stopped the
    whole report and failed alike for ever. Gone with its version (a gc meanwhile), or the bucket: raised as it is."""
    try:
        return remote.read(rel)
    except FileNotFoundError as e:
        if (lost := lost_object(remote, rel, e)) is not None:
            raise DamagedData(str(lost)) from None
        raise


def _damaged(url: str, base: str, name: str, why: str) -> DamagedData:
    return DamagedData(f"{url}/{base}/{name} is damaged ({why}); delete it (objects are never overwritten) and push "
                     "that version again from an intact store")
