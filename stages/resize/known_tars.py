"""Tars of a webdataset source unchanged since the newest complete `images` version: a rerun (a view setting such
as val_fraction or the control limits changed, shards added) yields their samples by their recorded rows, the tar
not opened (known_sources.py does the same per sample for a folder or JSONL source, by the same rule).

A tar's identity is the sha256 the file-hash cache holds for it (models/file_hashes.py: stands while size,
mtime_ns and ctime_ns are those it was hashed at), the one the listing hash (content.py) has just used; it hashed
every local tar there already (one pass, cached), so recording it costs no read; a tar read for the first time
is hashed from the bytes the reader streams instead (first_read.py). Each run records, beside the
version it commits (store/version_notes.py, note `source-tars`), each local tar it read whole or carried: its
sha256 before and after it was streamed (unchanged meanwhile) and how many samples the reader yielded from it,
problem samples included, and the resize.max_file_bytes and max_caption_bytes it read them under.

A rerun carries a tar unread only when its sha256 is the recorded one and every one of its samples has a row in
that version, offered as known_sources offers rows (rendered with the settings in force): as many rows under
`<tar>:` source names, none twice, as samples recorded. So a tar one of whose samples was quarantined or dropped
as a duplicate (no row) is read again, and gives its quarantine rows as a fresh run does. Its samples are yielded
with `known` (the stage judges them by their recorded key, control count and mask) in the version's row order,
not the tar's: within one such tar every key is distinct (rows of one table), so only the tars' order matters,
which is kept. Nothing is carried under a lower resize.max_file_bytes than recorded (a member now over it is
refused by the reader). A sample the stage must judge from its bytes after all (a copy of a key met in an earlier tar)
is read from its tar alone, by its members' offsets (`reread`, picture_heads.TarIndex); one whose headers must be
checked (a lowered resize.max_image_pixels, a transparent colour since revision 4: header_checks.py) from its
members' first bytes, and read whole only when they select it. A tar at a URL (http(s), s3) is judged by the sha256
of its URL, size and content tag (ETag, Content-MD5 or Last-Modified), the identity the listing hash already trusts
for it (shards.remote_tag: one metadata request, no byte of it read); one whose server sends no tag is read whole
each run (nothing says it is unchanged without a read), and one put again (another size or tag) is read whole. Its
headers are walked, and its members' first bytes read, by range requests (picture_heads.TarIndex). Not carried: a
tar whose name is not UTF-8, one unreadable now or not a regular file; every tar of a note written by another
revision of the tar reader's rules (`READER`).

A local parquet source's files are judged by the same rules (`parquet_kind`, note `source-parquet`): an unchanged
file, every row of it a row, is not read beyond its footer (parquet_source.iter_parquet checks each file's columns
from it); a row whose headers must be checked is read from its row group's mapped columns alone (one group a time,
kept for the rows after it: parquet_source._RowGroups), not its file whole; a changed file is read whole (a
rewritten parquet file's row groups shift, and their bytes are not hashed apart: finding the unchanged ones would
take a read of each anyway). Its note also records resize.columns (not in the render lineage: another mapping reads
other cells, so a note of another one carries nothing). A parquet file at a URL is judged too, by the
sha256 of its URL, size and content tag, as a tar at a URL.

Under a higher resize.max_caption_bytes than recorded (or none: a note made before the setting), a file holding a
row whose stored caption is over now's is read again (its sample refused as a fresh run refuses it).
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from models.file_hashes import FileHashes
from schemas.errors import UserError
from stages.resize.known_sources import TABLE, Known
from stages.resize.shards import RemoteTag
from stages.resize.sources import DEFAULT_MAX_CAPTION_BYTES
from store.remote import is_url

if TYPE_CHECKING:
    import pyarrow as pa

    from store import Store

NOTE = "source-tars"
# The rules by which webdataset_source.iter_webdataset makes samples of a tar's members (member names and case,
# dotfiles, which member is the caption or the mask): they are not in the render lineage, so a note records the
# revision it was written under and a note of another one carries nothing (its tars read, and their samples judged,
# anew).
# Bump it with any change to those rules.
READER = 1
# A parquet source's files, by the same rules (parquet_source.py): rows `<file>:<row>`. Its reader's rules (how a
# row's cells become a sample) have their own revision, and the note records resize.columns, which is not in the
# render lineage either (another mapping reads other cells: nothing carried).
PARQUET_NOTE = "source-parquet"
PARQUET_READER = 1
# A parquet note written under the rule that an unset resize.columns.mask reads a column `mask` (parquet_source.py):
# a version of the same listing whose note says so resolved it from these very footers (run_lineage._mask_by_a_version)
MASK_RULE = 1


@dataclass(frozen=True)
class Kind:
    """Which source files a note records: its name, its reader's revision, and the reading settings it must match."""

    note: str = NOTE
    reader_revision: int | None = None  # None: the tar reader's `READER`, as it is when read
    settings: dict | None = None  # recorded; a note with other ones carries nothing

    @property
    def reader(self) -> int:
        return READER if self.reader_revision is None else self.reader_revision


def parquet_kind(columns: Any) -> Kind:
    return Kind(PARQUET_NOTE, PARQUET_READER, {"columns": columns.model_dump(mode="json")})


class KnownTars:
    """tar -> its recorded samples while it is unchanged (`unchanged`); what this run read (`seen`, the note)."""

    def __init__(self, hashes: FileHashes, recorded: dict[str, tuple], rows: pa.Table | None,
                 by_tar: dict[str, list[int]], kind: Kind = Kind()) -> None:
        self._hashes, self._recorded, self._rows, self._by_tar, self.kind = hashes, recorded, rows, by_tar, kind
        self.seen: dict[str, list] = {}  # tar -> [sha256, samples yielded] of this run
        # tars hashed while streamed (first_read.py), and tar -> (sha256, its stat once streamed, when its stream
        # began: time.time_ns) of each streamed whole and unchanged meanwhile: cached just before the commit
        self.pending: frozenset[str] = frozenset()
        self.streamed: dict[str, tuple[str, os.stat_result, int]] = {}
        self._urls: dict[str, str | None] = {}  # url -> its identity, asked once a run (`fresh` asks again)
        self._etags: dict[str, str | None] = {}  # url -> its strong ETag as last asked (`match`)

    def identity(self, tar: str, fresh: bool = False) -> str | None:
        """The tar's sha256 by the cache's rule, not read; None where it is not known or would not be read. A file
        at a URL: the sha256 of its URL, size and content tag (ETag, Content-MD5 or Last-Modified, as the listing
        hash has them: shards.remote_tag), one metadata request; None when the server sends no tag (the listing
        then hashes its bytes: nothing here says it is unchanged without a read)."""
        if is_url(tar):
            if fresh or tar not in self._urls:
                self._urls[tar], self._etags[tar] = _remote_identity(tar)
            return self._urls[tar]
        try:
            if not os.access(tar, os.R_OK) or not stat.S_ISREG(os.stat(tar).st_mode):
                return None
            tar.encode("utf-8")  # a name that is not UTF-8 has no cache row
            return self._hashes.cached(tar)
        except (OSError, UnicodeEncodeError):
            return None

    def still(self, url: str, sha: str) -> bool:
        """Is the file at a URL still the one judged as `sha` (its size and tag asked again: one request)? False
        stops the run (picture_heads.refuse_put_again); an unreachable or refusing server is the store's line, as
        it says nothing of a put again. Its ETag asked is `match`'s from then on."""
        from stages.resize.shards import remote_source_errors

        try:
            with remote_source_errors(url):
                asked = _tag_unless_gone(url)
        except UserError:
            raise
        except Exception:  # noqa: BLE001  an error no line names: not the file judged (never a traceback)
            asked = None
        self._urls[url], self._etags[url] = _identity_of(url, asked)
        return self._urls[url] == sha

    def match(self, url: str) -> dict[str, Any]:
        """The keywords of range reads of the file at a URL that a server refuses (412) once it is put again: its
        strong ETag as its identity was last asked, as If-Match over http(s) (shards.if_match; none: a weak ETag,
        another tag, s3)"""
        from stages.resize.shards import if_match

        return if_match(url, self._etags.get(url))

    def count(self, tar: str) -> int | None:
        """Its recorded sample count when it would be carried (the progress bar's total), else None."""
        rec = self._recorded.get(tar)
        if rec is None or len(self._by_tar.get(tar, ())) != rec[1] or self.identity(tar) != rec[0]:
            return None
        return rec[1]

    def unchanged(self, tar: str) -> tuple[str, list[tuple[str, Known]]] | None:
        """(sha256, (source, known) of each sample) of a tar carried unread; None: read it (also a tar the source
        lists twice, met again: its samples are duplicates now, judged from their bytes)."""
        if tar in self.seen or self.count(tar) is None or self._rows is None:
            return None
        rows = self._rows.take(self._by_tar[tar]).to_pylist()
        return self._recorded[tar][0], [(r["source"], Known(r["key"], r["mask_sha256"], len(r["source_hashes"]) - 1,
                                                                      tuple(r["source_hashes"])))
                                        for r in rows]

    def note(self, tar: str, sha256: str, samples: int, headers: list[int] | None = None) -> None:
        """`headers`: a tar at a URL's member header offsets (picture_heads.TarIndex walks a carried one by them,
        concurrently), packed: deltas as little-endian int64, zlib (~2.2 bytes a member: 650 KB for 300k members)."""
        self.seen[tar] = [sha256, samples] + ([_packed(headers)] if headers and is_url(tar) else [])

    def headers(self, tar: str) -> list[int] | None:
        """The member header offsets recorded for a carried tar (its identity the recorded one), else None."""
        rec = self._recorded.get(tar)
        return _unpacked(rec[2]) if rec is not None and len(rec) > 2 else None


def known_tars(st: Store, rendered_before: dict[str, str], hashes: FileHashes, max_file_bytes: int,
               kind: Kind = Kind(), max_caption_bytes: int = DEFAULT_MAX_CAPTION_BYTES) -> KnownTars:
    """The tars (`kind`: or parquet files) recorded with the newest complete `images` version and unchanged now,
    with their offered rows. A sample whose headers must be checked (a lowered pixel limit, a transparent colour
    since revision 4, header_checks.py) is offered too: checked from its tar members' first bytes
    (picture_heads.TarIndex) or its parquet row group's image cells (parquet_source._RowGroups), the file
    carried. A row whose stored caption is over `max_caption_bytes` is not offered where the note records no lower
    caption limit (`_captions_checked`): its file is read whole and the sample refused, as a fresh run refuses it."""
    import pyarrow.compute as pc

    from store.integrity import DamagedData
    from store.manifest_files import checked_manifest
    from store.version_notes import read_note

    newest = st.newest_complete(TABLE)
    empty = KnownTars(hashes, {}, None, {}, kind)
    if newest is None or not rendered_before:
        return empty
    value = read_note(st, TABLE, newest[0], kind.note)
    recorded = _valid(value, max_file_bytes, kind)
    now = KnownTars(hashes, recorded, None, {}, kind)
    unchanged = {t for t, rec in recorded.items() if now.identity(t) == rec[0]}
    if not unchanged:
        return empty
    try:
        captions = [] if _captions_checked(value, max_caption_bytes) else ["caption"]
        rows = checked_manifest(st.version_dir(TABLE, newest[0]),
                                ["key", "source", "source_hashes", "mask_sha256", *captions])
    except (UserError, DamagedData):  # unreadable or damaged: every tar read, as before
        return empty
    if not {"source", "source_hashes", "mask_sha256"} <= set(rows.column_names):
        return empty
    # a source name twice (a key's members in two runs of one tar): which row is which sample is not known
    counts = pc.value_counts(rows.column("source"))
    read_whole = {_tar_of(s, unchanged) for s in pc.filter(counts.field("values"), pc.greater(counts.field("counts"), 1))
             .to_pylist() if isinstance(s, str)}
    by_tar: dict[str, list[int]] = {}
    i = 0
    for batch in rows.to_batches(max_chunksize=65536):
        n_hashes = pc.fill_null(pc.list_value_length(batch.column("source_hashes")), 0).to_pylist()
        fits = _captions_fit(batch, max_caption_bytes)
        for key, source, n, mask, fit in zip(batch.column("key").to_pylist(), batch.column("source").to_pylist(),
                                             n_hashes, batch.column("mask_sha256").to_pylist(), fits):
            tar = _tar_of(source, unchanged) if isinstance(source, str) else None
            if tar is not None and n and mask is not None and rendered_before.get(key) == mask and fit:
                by_tar.setdefault(tar, []).append(i)
            i += 1
    known = KnownTars(hashes, {t: recorded[t] for t in unchanged}, rows,
                      {t: idx for t, idx in by_tar.items() if t not in read_whole}, kind)
    known._urls, known._etags = now._urls, now._etags  # the URLs' identities just asked: not asked again
    return known


def _remote_identity(url: str) -> tuple[str | None, str | None]:
    """(identity, strong ETag or None) of a tar at a URL."""
    from stages.resize.shards import remote_tag

    try:
        asked = remote_tag(url)
    except (UserError, OSError):  # gone, or the server unreachable: read it (the reader says what is wrong)
        return None, None
    return _identity_of(url, asked)


def _tag_unless_gone(url: str) -> RemoteTag | None:
    """The size and tag of a file at a URL; None for one not found (gone: not the file judged). fsspec's http says
    FileNotFoundError for an unreachable server and an error answer too: those go on to the store's line. The
    client's other errors as raised (the caller names them: shards.remote_source_errors)."""
    from stages.resize.shards import remote_fs, tag_of
    from store.remote import http_answer, unreachable

    fs, path = remote_fs(url)
    try:
        info = fs.info(path)
    except FileNotFoundError as e:
        if unreachable(e) is None and http_answer(e) is None:
            return None
        raise
    return tag_of(info)


def _identity_of(url: str, asked: RemoteTag | None) -> tuple[str | None, str | None]:
    """(identity, strong ETag or None) of a file at a URL by its size and tag as asked (None: not known)."""
    if asked is None or asked.text is None:
        return None, None
    return hashlib.sha256(f"{url}\0{asked.size} {asked.text}".encode()).hexdigest(), asked.strong_etag


def _captions_checked(value: object, max_caption_bytes: int) -> bool:
    """Were the note's files read under a resize.max_caption_bytes no higher than now's? A note made before the
    setting records none: its rows' stored captions are checked instead (`_captions_fit`)."""
    limit = value.get("max_caption_bytes") if isinstance(value, dict) else None
    return isinstance(limit, int) and limit <= max_caption_bytes


def _captions_fit(batch: Any, max_caption_bytes: int) -> list[bool]:
    """Each row's stored caption within the limit (all, where the caption column was not read). The stored caption
    is the one read less a BOM, outer whitespace and control characters (caption_text.py): never longer."""
    import pyarrow.compute as pc

    if "caption" not in batch.schema.names:
        return [True] * batch.num_rows
    sizes = pc.fill_null(pc.binary_length(batch.column("caption")), 0)
    return pc.less_equal(sizes, max_caption_bytes).to_pylist()


def note_value(known: KnownTars, max_file_bytes: int, max_caption_bytes: int) -> dict:
    """What a run records beside the version it commits."""
    return {"tars": known.seen, "max_file_bytes": max_file_bytes, "max_caption_bytes": max_caption_bytes,
            "reader": known.kind.reader,
            **({"mask_rule": MASK_RULE} if known.kind.note == PARQUET_NOTE else {}), **(known.kind.settings or {})}


def _valid(value: object, max_file_bytes: int, kind: Kind = Kind()) -> dict[str, tuple[str, int]]:
    """The note's tars (files), each a [sha256, count], when read under a resize.max_file_bytes no higher than
    now's, by this reader revision, with these reading settings; anything else in a hand-edited note is left out."""
    tars = value.get("tars") if isinstance(value, dict) else None
    limit = value.get("max_file_bytes") if isinstance(value, dict) else None
    if not isinstance(tars, dict) or not isinstance(limit, int) or limit > max_file_bytes or \
            value.get("reader") != kind.reader or any(value.get(k) != v for k, v in (kind.settings or {}).items()):
        return {}
    return {t: tuple(v) for t, v in tars.items() if isinstance(v, list) and len(v) in (2, 3)
            and isinstance(v[0], str) and len(v[0]) == 64 and isinstance(v[1], int) and v[1] >= 0
            and (len(v) == 2 or isinstance(v[2], str))}


def _packed(headers: list[int]) -> str:
    import numpy as np

    return base64.b64encode(zlib.compress(np.diff(np.asarray(headers, "<i8"), prepend=0).tobytes(), 6)).decode()


def _unpacked(packed: str) -> list[int] | None:
    """The offsets, or None for a value that is not one (hand-edited, damaged): the tar is then walked."""
    import numpy as np

    try:
        deltas = np.frombuffer(zlib.decompress(base64.b64decode(packed, validate=True)), "<i8")
    except (ValueError, zlib.error):
        return None
    if len(deltas) == 0 or deltas[0] < 0 or (deltas[1:] < 512).any():  # a header is 512 bytes at least
        return None
    return np.cumsum(deltas).tolist()


def _tar_of(source: str, tars: set[str]) -> str | None:
    """The tar of a `<tar>:<key>` source name among `tars` (a path or key may hold ':' itself)."""
    at = source.find(":")
    while at != -1:
        if source[:at] in tars:
            return source[:at]
        at = source.find(":", at + 1)
    return None
