"""`pipeline store verify URL`: every check of the local verify, with each object read once where it lies.

Only the small files the checks parse are fetched, into a temporary folder: `store.json`, `quarantine.parquet`, and
per complete version `checksums.json`, `schema.json`, `manifest.parquet`. The local verify (store/verify.py) checks
those there; every other file a version lists (shards, shard indexes, rank-done files) is streamed from the remote
once (`TRANSFERS` at a time): its CRC32C computed over the bytes as they pass and compared with the sealed
`checksums.json`, and each manifest row's sample checked from its bytes on the way (sample checksum, tar members,
safetensors header) - then dropped. Nothing is written to the cache, and a 1M-sample store is never held on disk:
the verify of a URL costs one read of its bytes and ~a shard's worth of memory per transfer.

Why not trust the server's own checksums instead: S3's ETag is an MD5 only for single-part uploads, and our CRC32C
metadata is written by the uploader from the local file - neither sees a byte damaged at rest or by a server
that lies. Reading every byte is the one check that finds what a reader would find.

A listing (one per verify) gives every object's size: a missing or short object is named without a GET, and an
object under a version's prefix that its `checksums.json` does not list is reported as the local verify reports
an unlisted file. Nothing is recorded on the remote (its versions are immutable; `store repair URL` acts on what
verify names).
"""

from __future__ import annotations

import hashlib
import json
from contextlib import closing
from pathlib import Path
from typing import Any

from schemas.byte_bar import byte_bar
from schemas.errors import UserError
from schemas.newer import WrittenByNewer
from store import format as fmt
from store import remote_download
from store.checksum import RunningCrc
from store.remote import READ_PIECE, Remote, SharedBar, each_at_once, is_transport_error
from store.remote_lease import hold_reading, release_reading
from store.remote_parts import SOURCE_URL
from store import quarantine
from store.remote_sync import _MANIFEST_RE, _parse_record, damaged_quarantine, marker_rel
from store.remote_view import listed_store
from store.verify import LITTER_NOTE, REMOTE_METADATA, ShardPart, check_sample, shard_rows, verify_store



def current_versions(root: Path) -> dict[str, int]:
    """{table: current version} as root's store.json names them; {} when it is damaged (verify says so)."""
    try:
        tables = json.loads((root / fmt.STORE_JSON).read_text()).get("tables", {})
        return {t: int(e["current"]) for t, e in tables.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def verify_url(url: str, storage_options: dict[str, Any] | None = None, progress: bool = True
               ) -> tuple[list[str], dict[str, int]]:
    """(every problem of the store at `url` as one line, as `store.verify.verify_store`; its current versions);
    UserError when there is no store there or the connection is lost."""
    url = url.rstrip("/")
    with listed_store(url, storage_options, "verify") as (remote, root, listing):
        (root / fmt.STORE_JSON).write_bytes(remote.read(fmt.STORE_JSON, small=True))  # as it is: verify checks it
        # the copy of `url`'s metadata, as a cache is: what cannot be repaired is advised as at a URL (push again)
        (root / SOURCE_URL).write_text(url)
        damaged: list[str] = []
        if fmt.QUARANTINE in listing:  # damaged: named by its URL (as pull, push say it), versions still checked
            data = remote.read(fmt.QUARANTINE, small=True)
            if why := quarantine.parsed(data)[1]:
                damaged.append(str(damaged_quarantine(url, why)))
            else:
                (root / fmt.QUARANTINE).write_bytes(data)
        for rel in sorted(listing):
            m = _MANIFEST_RE.fullmatch(rel)
            if not m or marker_rel(m.group(1), int(m.group(2))) in listing:  # retired by `store repair URL`
                continue
            base = f"{m.group(1)}/v{m.group(2)}"
            (root / base).mkdir(parents=True)
            for name in (fmt.CHECKSUMS, *REMOTE_METADATA):
                if f"{base}/{name}" in listing:
                    (root / base / name).write_bytes(remote.read(f"{base}/{name}"))
        # a read lease, as every reader: a `store gc` meanwhile must not remove (and verify call missing) a version
        versions = sorted((p.parent.name, int(p.name[1:])) for p in root.glob("*/v*"))
        hold_reading(url, versions, storage_options, root=root)
        try:
            objects = RemoteObjects(remote, listing, progress)
            problems = verify_store(root, progress, objects)
        except WrittenByNewer as e:  # named by its URL, not the temporary folder
            raise WrittenByNewer(str(e).replace(str(root), url)) from None
        finally:
            release_reading(url)
        if objects.lost is not None:  # verify_store made it a problem line: it is the connection, not the data
            raise objects.lost
        current = current_versions(root)
        record = str(root / fmt.STORE_JSON)
        # a damaged store.json of a URL: what push and the stages say (`store repair URL` rebuilds it)
        problems = [_record_problem(root, url) if p.startswith(record) else p for p in problems]
    return damaged + [p.replace(str(root), url) for p in problems], current


def _record_problem(root: Path, url: str) -> str:
    try:
        _parse_record((root / fmt.STORE_JSON).read_bytes(), url)
    except UserError as e:
        return str(e)
    return f"{url}/{fmt.STORE_JSON} is unreadable; run `pipeline store repair {url}` (rebuilt from the versions there)"


class RemoteObjects:
    """verify_store's `objects`: checks a version's files other than its metadata where they lie."""

    def __init__(self, remote: Remote, listing: dict[str, int], progress: bool) -> None:
        self.remote, self.listing, self.progress = remote, listing, progress
        self.lost: BaseException | None = None

    def __call__(self, name: str, sums: dict[str, dict[str, Any]] | None,
                 by_shard: dict[str, ShardPart]) -> list[str]:
        if self.lost is not None:  # the connection is gone: verify_url says so once, no version is checked on
            raise self.lost
        problems: list[str] = []
        prefix = f"{name}/"
        if sums is not None:  # objects the record does not list (the local verify's unlisted files)
            for rel in sorted(r for r in self.listing if r.startswith(prefix)):
                fname = rel[len(prefix):]
                if fname in sums or fname == fmt.CHECKSUMS:
                    continue
                problems.append(f"{rel}: {LITTER_NOTE}" if fmt.is_litter(fname.rsplit('/', 1)[-1])
                                else f"{rel}: not listed in {fmt.CHECKSUMS}")
        names = sorted(({n for n in (sums or {}) if n not in REMOTE_METADATA} | set(by_shard)))
        total = sum(self.listing.get(prefix + n, 0) for n in names)
        with byte_bar(total, f"verify {name}", disable=not self.progress) as bar:
            shared = SharedBar(bar)
            for found in each_at_once(lambda n: self._part(name, n, sums, by_shard.get(n), shared), names):
                problems += found
        return problems

    def _part(self, name: str, fname: str, sums: dict[str, dict[str, Any]] | None, part: ShardPart | None,
              bar: SharedBar) -> list[str]:
        rows, bad = shard_rows(part, name) if part is not None else ([], [])
        return bad + self._object(name, fname, (sums or {}).get(fname), sums is None, rows, bar)

    def _object(self, name: str, fname: str, entry: dict[str, Any] | None, no_record: bool,
                rows: list[dict[str, Any]], bar: SharedBar) -> list[str]:
        rel = f"{name}/{fname}"
        size = self.listing.get(rel)
        if size is None:
            return ([f"{rel}: missing"] if entry is not None else []) + (
                [f"{rel}: shard file missing ({len(rows)} samples)"] if rows else [])
        problems: list[str] = []
        if entry is not None and size != entry["nbytes"]:
            problems.append(f"{rel}: size {size} bytes, {fmt.CHECKSUMS} records {entry['nbytes']}")
        sha = None
        if rows:
            recorded = {(r["shard_sha256"], r["shard_nbytes"]) for r in rows}
            if len(recorded) != 1:
                problems.append(f"{rel}: manifest rows disagree on the shard's checksum/size")
                rows = []
            else:
                (want_sha, nbytes), = recorded
                if size != nbytes:
                    problems.append(f"{rel}: size {size} bytes, manifest records {nbytes}")
                if no_record:  # format 1 (or a damaged checksums.json): the shard's sha256, as the local verify
                    sha = hashlib.sha256()
        try:
            crc, row_problems = self._stream(rel, size, rows, sha, bar)
        except FileNotFoundError:  # removed since the listing
            return problems + [f"{rel}: missing"]
        except Exception as e:
            if is_transport_error(e) or isinstance(e, (PermissionError, UserError)):
                self.lost = self.lost or e
                raise
            return problems + [f"{rel}: cannot be checked ({type(e).__name__}: {e})"]
        if entry is not None and size == entry["nbytes"] and crc != entry["crc32c"]:
            problems.append(f"{rel}: crc32c {crc}, {fmt.CHECKSUMS} records {entry['crc32c']}: the file is damaged")
        if sha is not None and sha.hexdigest() != want_sha:
            problems.append(f"{rel}: sha256 mismatch (recorded {want_sha[:12]}…, found {sha.hexdigest()[:12]}…): "
                            "shard is corrupt")
        return problems + row_problems

    def _stream(self, rel: str, size: int, rows: list[dict[str, Any]], sha: Any, bar: SharedBar
                ) -> tuple[str, list[str]]:
        """One sequential read of the object: (its CRC32C, the problems of `rows`' samples). Only the sample being
        checked is held, never the object."""
        crc = RunningCrc()
        problems: list[str] = []
        path = self.remote.path(rel)
        # one streamed GET, a piece at a time (store/remote_download.py): s3fs's file object held 8 MiB blocks
        with closing(remote_download.pieces(self.remote.fs, path, READ_PIECE, self.remote.is_s3)) as stream:
            pos, left = 0, memoryview(b"")

            def read(m: int) -> bytes:
                nonlocal left
                if not left:
                    left = memoryview(next(stream, b""))
                got, left = left[:m], left[m:]
                return bytes(got)

            def take(n: int, keep: bool) -> bytes:
                nonlocal pos
                out = []
                while n > 0:
                    piece = read(min(n, READ_PIECE))
                    if not piece:
                        raise EOFError(f"{rel} ended at byte {pos} of {size}")
                    crc.update(piece)
                    if sha is not None:
                        sha.update(piece)
                    bar.update(len(piece))
                    pos, n = pos + len(piece), n - len(piece)
                    if keep:
                        out.append(piece)
                return b"".join(out)

            for r in sorted(rows, key=lambda r: r["sample_offset"]):
                start, n = r["sample_offset"], r["sample_nbytes"]
                if start < 0 or start + n > size:
                    problems.append(f"{rel}: key {r['key']}: sample bytes [{start}, {start + n}) lie outside the shard")
                    continue
                if start < pos:  # overlaps the previous sample (never written so): its own range read
                    data = self.remote.fs.cat_file(path, start, start + n)
                else:
                    take(start - pos, keep=False)
                    data = take(n, keep=True)
                try:
                    problems += [f"{rel}: key {r['key']}: {p}" for p in check_sample(data, r)]
                except Exception as e:  # noqa: BLE001 - a manifest with nonsense values is a problem line
                    problems.append(f"{rel}: key {r.get('key')!r}: cannot be checked ({type(e).__name__}: {e})")
            take(size - pos, keep=False)
        return crc.hex(), problems
