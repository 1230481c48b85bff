"""Samples of the newest complete `images` version whose source files are unchanged: a rerun (a view setting such as
val_fraction or the control limits changed, a few samples added) carries them forward without reading their image
bytes or hashing their key again (a folder or JSONL source: its reader, folder_source.py or jsonl_source.py, asks
`KnownSources.get` before reading a sample).

A sample's key (images_table.sample_key: sha256 of target + controls + caption) needs every byte of it. A row
records its source name, the sha256 of each target/control file (`source_hashes`), of its mask (`mask_sha256`) and
its caption. A sample found now under the same source name whose files' sha256, as the file-hash cache knows them,
are the recorded ones, and whose caption (a folder's .txt, small, read; a JSONL's, in its line) is the recorded one,
has the recorded bytes: the recorded key. Only rows whose key and mask an earlier version holds with the same render
settings (earlier_versions.reusable_renders) are offered: the others must be rendered, so read, anyway.

What is trusted is the cache's own rule (models/file_hashes.py), the one the listing hash has just applied to every
file: a cached sha256 stands while the file's size, mtime_ns and ctime_ns are those it was hashed at (same real
path, or the same inode on a local file system). rsync and make trust size + mtime alone; ctime is added because no
user-space call sets it: a file rewritten in place with the same size, even with its mtime put back (`touch -r`,
`cp -p`), has a new ctime, so it is read and hashed again. Read as before (so judged and quarantined as before): a
file with no or a stale cache row, one unreadable now, outside the source, not a regular file or over
resize.max_file_bytes, a sample whose name is not UTF-8, and every sample of a parquet source (its bytes come with
the batch anyway). A webdataset source is judged per tar by the same cache rule (known_tars.py).

Held as resumed_sources.ResumedSources (a 128-bit digest of the source name -> key + 128-bit identity: ~90 B a
sample).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from models.file_hashes import FileHashes
from stages.resize.caption_text import clean_caption
from stages.resize.folder_listing import _inside
from stages.resize.resumed_sources import ResumedSources

if TYPE_CHECKING:
    from store import Store

TABLE = "images"


@dataclass(frozen=True)
class Known:
    key: str
    mask_sha256: str  # "" for no mask
    controls: int
    source_hashes: tuple[str, ...] = ()  # the target's and controls' sha256s (their split: split_rule.py)


def _identity(hashes: list[str], mask_sha256: str, caption: str) -> str:
    text = json.dumps([hashes, mask_sha256, caption])  # ASCII (escaped), unambiguous
    return hashlib.blake2b(text.encode("ascii"), digest_size=16).hexdigest()


class KnownSources:
    """source -> the recorded sample, answered only while its files still match (`get`)."""

    def __init__(self, recorded: ResumedSources, hashes: FileHashes, max_file_bytes: int) -> None:
        self._recorded, self._hashes, self._max = recorded, hashes, max_file_bytes

    def __len__(self) -> int:
        return len(self._recorded)

    def recorded(self, source: str) -> bool:
        return len(self._recorded) > 0 and self._recorded.get(source) is not None

    def get(self, source: str, images: list[tuple[Path, Path | None]], mask: tuple[Path, Path | None] | None,
            caption: bytes) -> Known | None:
        """The recorded sample when `images` (target, controls), `mask` (each a path and the folder the reader keeps
        it within, None: anywhere) and the caption bytes are those recorded under `source`; None: read it."""
        value = self._recorded.get(source) if len(self._recorded) else None
        if value is None:
            return None
        digests = [self._cached(*p) for p in images]
        mask_digest = "" if mask is None else self._cached(*mask)
        if mask_digest is None or any(d is None for d in digests):
            return None
        try:
            caption_text = clean_caption(caption)
        except UnicodeDecodeError:
            return None
        if not caption_text or _identity(digests, mask_digest, caption_text) != value[32:]:
            return None
        return Known(value[:32], mask_digest, len(images) - 1, tuple(digests))

    def _cached(self, path: Path, root: Path | None) -> str | None:
        """The file's sha256 by the cache's rule, without reading it; None where the reader would refuse the file
        or the cache does not know its current bytes."""
        name = str(path)
        try:
            name.encode("utf-8")  # a non-UTF-8 name has no cache row (content.py hashes it uncached)
            if root is not None and not _inside(path, root) or not os.access(path, os.R_OK):
                return None
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size > self._max:
                return None
            return self._hashes.cached(path)
        except (OSError, UnicodeEncodeError):
            return None


def known_sources(st: Store, rendered_before: dict[str, str], hashes: FileHashes,
                  max_file_bytes: int) -> KnownSources:
    """The rows of the newest complete `images` version that a rerun may carry without reading (module doc)."""
    from schemas import UserError
    from store.integrity import DamagedData
    from store.manifest_files import checked_manifest

    newest = st.newest_complete(TABLE)
    parts: list[tuple[list[str], list[str]]] = []
    if newest is not None and rendered_before:
        try:
            rows = checked_manifest(st.version_dir(TABLE, newest[0]),
                                    ["key", "source", "source_hashes", "mask_sha256", "caption"])
        except (UserError, DamagedData):  # unreadable or damaged: every sample read, as before
            rows = None
        if rows is not None and {"source", "source_hashes", "mask_sha256", "caption"} <= set(rows.column_names):
            parts = list(_offered(rows, rendered_before))
    return KnownSources(ResumedSources(parts), hashes, max_file_bytes)


def _offered(rows, rendered_before: dict[str, str]) -> Iterator[tuple[list[str], list[str]]]:
    """(sources, key + identity) per batch of rows, for the rows whose key and mask are rendered with the settings
    in force."""
    for batch in rows.to_batches(max_chunksize=65536):
        sources, values = [], []
        for key, source, hashes, mask, caption in zip(*(batch.column(c).to_pylist() for c in (
                "key", "source", "source_hashes", "mask_sha256", "caption"))):
            if None in (source, hashes, mask, caption) or rendered_before.get(key) != mask or len(key) != 32:
                continue
            sources.append(source)
            values.append(key + _identity(list(hashes), mask, caption))
        yield sources, values
