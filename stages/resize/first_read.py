"""Local tars and parquet files a run reads for the first time are read once, not twice: their sha256 (for the
source listing hash, content.py, and the source-tars / source-parquet note, known_tars.py) is taken from the bytes
the reader reads (a tar's stream, `HashingStream`; a parquet file's reads, hashed_parquet.py), not by a pass of its
own before. Below, "tar" stands for either.

Which tars (`pending_tars`): local tars the file-hash cache does not know (no read: models/file_hashes.py's rule)
and the source-tars note of the newest complete `images` version does not name. A tar that note names is hashed
first as before: it was seen, so it is probably unchanged, and the version may be up to date without any other read.
None at all when the store holds complete versions but that note names none of the source's tars (or there is no
note: a store URL's cache, a version written before notes): an earlier version may be of this very listing, found
only by the hashes (the source copied elsewhere; settings of an older version rerun on another machine).

Until their bytes are known the version is written under a provisional listing hash, in which each such tar
stands for its stat stamp (size, mtime_ns, ctime_ns: the cache's own rule). A killed run's rerun computes the same
provisional hash (nothing is cached before the commit, the note is unchanged), so it resumes that version. Just
before the commit (`settle_listing`) each tar streamed whole and unchanged meanwhile has its sha256 put in the
file-hash cache, the listing hash is made again from the lines hashed at the start with those sha256 in place of the
stamps (a tar not streamed whole, or changed since, gets a stand-in no run computes: its rows hold the bytes read
then, so the next run reads it again), and the in-progress version's schema.json gets that lineage: the version
commits under the lineage an unchanged source has on the next run (up to date, nothing read). A kill after
schema.json is rewritten: the rerun finds the tars cached, so the same listing, and resumes the version; a kill
between the cache write and that rewrite: the rerun finds the version by its record of pending tars (`settling`).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable

from models.file_hashes import FileHashes
from schemas import atomic_write
from stages.resize.known_tars import NOTE, PARQUET_NOTE, TABLE
from stages.resize.shards import shard_urls
from store.remote import is_url

if TYPE_CHECKING:
    from schemas.table import TableSchema
    from store import Store

CHUNK = 1 << 20


def pending_tars(st: Store, source: str | Path, fmt: str) -> frozenset[str]:
    """The source's local tars (parquet files) to hash while they are read (module doc); none for other formats
    and in a `store repair`, which must find the damaged version's exact lineage up front."""
    from stages.resize.parquet_source import parquet_files
    from store import repair_context
    from store.version_notes import read_note

    if fmt not in ("webdataset", "parquet") or repair_context.active() or (fmt == "parquet" and is_url(source)):
        return frozenset()
    tars = [t for t in shard_urls(source) if not is_url(t)] if fmt == "webdataset" else \
        [str(f) for f in parquet_files(source)]
    if not tars:
        return frozenset()
    newest = st.newest_complete(TABLE)
    note = read_note(st, TABLE, newest[0], NOTE if fmt == "webdataset" else PARQUET_NOTE) \
        if newest is not None else None
    named = note.get("tars") if isinstance(note, dict) else None
    named = named if isinstance(named, dict) else {}
    if newest is not None and not any(t in named for t in tars):
        # the store holds versions but none read these tars here (a note of another source, of this one at another
        # path, or none: a store URL's fresh cache): one of them may be this very listing (up to date, or adopted
        # from the URL), which only the hashes tell; a provisional one matched none, and every image was rendered
        return frozenset()
    out = set()
    with FileHashes() as hashes:
        for t in tars:
            try:
                t.encode("utf-8")  # a name that is not UTF-8 has no cache row: hashed first, as before
                if t in named or not os.access(t, os.R_OK) or not stat.S_ISREG(os.stat(t).st_mode) or \
                        hashes.cached(t) is not None:
                    continue
            except (OSError, UnicodeEncodeError):
                continue
            out.add(str(Path(t)))
    return frozenset(out)


def file_stamp(path: str | Path) -> tuple[int, int, int, int] | None:
    """What must be the same when a tar's read ends as when it began for its hash to stand (the cache's
    `learn` checks it again at the commit); None when it is gone or unreadable (the reader says so)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def stamp(path: str | Path) -> str:
    """What stands for a pending tar in the provisional listing hash."""
    st = os.stat(path)
    return f"streamed {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


class HashingStream:
    """A shard's stream whose bytes are hashed as the reader takes them; on close the rest (the tar's end blocks
    and padding, or what a truncated read left) is read into the hash too, so `digest` is the whole file's."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw, self._h, self.whole, self._failed = raw, hashlib.sha256(), False, False

    def read(self, n: int = -1) -> bytes:
        try:
            b = self.raw.read(n)
        except OSError:  # a read error (EIO): the bytes it skipped are not in the hash, which is no file's then
            self._failed = True
            raise
        self._h.update(b)
        return b

    def close(self) -> None:
        if self.raw.closed:
            return
        try:
            # after a read error the digest is no file's: the rest of a large tar is not read for nothing
            while not self._failed and (b := self.raw.read(CHUNK)):
                self._h.update(b)
            self.whole = not self._failed
        finally:
            self.raw.close()

    def digest(self) -> str | None:
        return self._h.hexdigest() if self.whole else None


# Beside the provisional schema.json of an in-progress version: which tars stood for their stamps. A run killed after
# the streamed hashes went into the cache, before schema.json was rewritten, computes another listing (those tars
# are cached now): it finds the version by this record (`settling`) instead of rendering everything anew. Removed
# once schema.json holds the final lineage, so never part of a committed version.
PENDING_JSON = ".provisional-tars.json"


# Beside the schema.json of a version a read error kept files out of, written just before it is rewritten with that
# lineage (`settle_listing`): the schema the version was opened with and the tars pending then. A run killed from
# there to the commit leaves a schema no rerun computes (its listing names the unread files); the rerun finds the
# version by this record (`settling`), puts the opened schema back and resumes it, rather than rendering all anew.
# A committed version keeps it (listed in its checksums, read by nothing).
READ_ERRORS_JSON = ".read-errors.json"


def record_pending(writer: Any, pending: frozenset[str]) -> None:
    """The record of the opened version's pending tars; with none, a record a run killed after its schema.json
    rewrite left is removed (the version resumes under its final lineage, and commits without it). A read-error
    record a killed run left goes too: this run's settling writes it again if files still fail."""
    from store import format as fmt

    (writer.dir / READ_ERRORS_JSON).unlink(missing_ok=True)
    if pending:
        fmt.atomic_write_json(writer.dir / PENDING_JSON, {"tars": sorted(pending)})
    else:
        (writer.dir / PENDING_JSON).unlink(missing_ok=True)


def settling(st: Store, fmt_name: str, pending: frozenset[str], want: dict,
             provisional: Callable[[frozenset[str]], tuple[TableSchema, Any]]) -> tuple[frozenset[str], Any] | None:
    """(pending tars, (schema, listing)) of an in-progress version a killed run left between the cache write and
    the schema.json rewrite (its record names the tars; `provisional(tars)` gives the schema they stand for now,
    equal to its schema.json while they are unchanged); None when there is none, or when an in-progress version
    of `want` (this run's schema) is there to resume anyway. A version killed after a rewrite that marked files a
    read error kept out (READ_ERRORS_JSON) is judged by the schema it was opened with, which is put back."""
    from store import format as fmt
    from store import repair_context

    if repair_context.active():
        return None
    found = []
    for v in reversed(fmt.list_versions(st.root, TABLE)):
        vdir = fmt.version_dir(st.root, TABLE, v)
        if fmt.is_complete(vdir) or not (vdir / fmt.SCHEMA_JSON).is_file():
            continue
        try:
            schema = fmt.read_json(vdir / fmt.SCHEMA_JSON, "schema.json")
            record = fmt.read_json(vdir / READ_ERRORS_JSON, READ_ERRORS_JSON) \
                if (vdir / READ_ERRORS_JSON).is_file() else None
        except Exception:  # noqa: BLE001 - a damaged in-progress folder is the writer's to judge, not this look's
            continue
        if schema == want:
            return None
        opened = record.get("opened") if isinstance(record, dict) else None
        if opened is not None and opened == want:
            _reopen(st, vdir, opened)
            return None
        if opened is not None and isinstance(record.get("tars"), list) and record["tars"]:
            found.append((vdir, opened, record))  # its schema.json is the read-error one, its pending record aside
        elif (vdir / PENDING_JSON).is_file():
            found.append((vdir, schema, None))
    for vdir, schema, record in found:
        try:
            tars = record["tars"] if record is not None else fmt.read_json(vdir / PENDING_JSON, PENDING_JSON)["tars"]
            tars = frozenset(str(t) for t in tars)
        except Exception:  # noqa: BLE001 - a hand-edited record: that version is not resumed, as before
            continue
        if tars == pending:
            continue
        made = provisional(tars)
        if made[0].to_dict() == schema:
            if record is not None:
                _reopen(st, vdir, schema)
            return tars, made
    return None


def _reopen(st: Store, vdir: Path, opened: dict) -> None:
    """The schema a version was opened with put back over its read-error one (READ_ERRORS_JSON), under the
    table's writer lock, for this run's writer to resume it."""
    from store import format as fmt
    from store.writer_open import lock_rank

    lock = lock_rank(st.root, TABLE, 0)
    try:
        if not fmt.is_complete(vdir) and (vdir / READ_ERRORS_JSON).is_file():
            fmt.atomic_write_json(vdir / fmt.SCHEMA_JSON, opened)
            (vdir / READ_ERRORS_JSON).unlink()
            atomic_write.fsync_dir(vdir)
    finally:
        lock.release()


def settle_listing(writer: Any, streamed: dict[str, tuple[str, os.stat_result, int]], pending: frozenset[str],
                   listing: Any, schema_for: Callable[[str], TableSchema],
                   unread: frozenset[str] = frozenset()) -> TableSchema:
    """Before the commit of a version written under a provisional listing (`listing`, content.Listing: its lines
    as hashed at the run's start): the streamed tars' sha256 cached, the listing hash made again with them in
    place of their stamps, the version's schema.json rewritten with `schema_for(listing)`, which is returned, and
    its record of pending tars removed (module doc). A pending tar not streamed whole, or changed since its stream
    began, gets a stand-in no run computes: its rows hold the bytes read then, not those there now, so the next run
    reads it again (a hash of it now would call that run up to date). So does every file of `unread` (any format:
    a read error kept samples of it out of the version; its line stays, saying `left unread` for its digest, and
    a stand-in line is added), whether or not any tar was pending: the version is not the one of a source read
    whole."""
    from store import format as fmt

    with FileHashes() as hashes:
        learned = {str(Path(tar)): digest for tar, (digest, before, started) in streamed.items()
                   if hashes.learn(tar, digest, before, started)}
    fmt.crash_point("listing_cached")
    settled = {path: learned.get(path, f"changed while read: {digest}")
               for path, digest in listing.digests(pending).items()}
    schema = schema_for(listing.hash(settled, unread))
    if unread:  # a kill from here to the commit: the rerun finds the version by what it was opened as (`settling`)
        fmt.atomic_write_json(writer.dir / READ_ERRORS_JSON,
                              {"opened": writer.schema.to_dict(), "tars": sorted(pending)})
    fmt.atomic_write_json(writer.dir / fmt.SCHEMA_JSON, schema.to_dict())
    writer.schema = schema
    fmt.crash_point("listing_rewritten")
    (writer.dir / PENDING_JSON).unlink(missing_ok=True)
    atomic_write.fsync_dir(writer.dir)
    fmt.crash_point("listing_settled")
    return schema
