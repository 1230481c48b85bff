"""Source identity by content: the listing hash of a source is built from each file's relative path and the
sha256 of its bytes, so touching a file or copying the dataset elsewhere changes nothing. Hashes are cached by
(real path, size, mtime, ctime), and on local file systems by inode too, so a rerun over an unchanged source, also
one moved or renamed since, reads no image bytes at all.

Per format: a folder, JSONL or parquet source, and local tar shards (a folder of them or a brace list), by their
files (`sources.source_files`; parquet: the parquet files); tar shards at URLs by URL, size and the server's
content tag (ETag, else Content-MD5, else Last-Modified; the bytes' sha256 when the server sends none), from one
metadata request per shard (`shards.remote_identity`). A changed source is re-rendered, an unchanged one reused.

The cache is `models.file_hashes.FileHashes` (sqlite, one row per path): the same database file the model
fingerprints use.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from models.file_hashes import FileHashes
from schemas.file_digest import file_sha256

from stages.resize.first_read import stamp
from stages.resize.shards import is_shard_list, remote_listing, remote_source_files
from stages.resize.sources import printable, source_files
from store.remote import is_url


class Listing:
    """The lines a listing hash was made of, kept to settle a provisional listing (first_read.py): the pending tars'
    lines get the sha256 of the bytes streamed, every other line stays as it was hashed at the run's start (a file
    changed during the run must not lend its new bytes' hash to rows rendered from the old ones).

    Kept as the bytes hashed, one buffer, and where each line ends: ~140 B a file (a line's name and digest) where
    a tuple of (path, name, digest) strings held ~430 B (a 1M-sample folder source of 3M files: ~1.2 GB, of it
    the path's str kept alive by its Path); a line's local path is `prefix` + its name but where it is not."""

    def __init__(self) -> None:
        self.prefix = ""  # the source's folder, as content_listing_hash names files relative to it
        self._text = bytearray()  # each line as hashed: `name\0digest\n` (a URL line: `line\n`)
        self._ends = array("Q")  # where each line ends in _text
        self._paths: dict[int, str | None] = {}  # line -> its local path where not prefix + name (None: a URL line)

    def add(self, path: str | None, name: str, digest: str = "") -> None:
        """A local file's line (`path`, its `name` in the listing, `digest`), or a URL line (`path` None)."""
        self._text += f"{name}\n".encode() if path is None else \
            f"{name}\0{digest}\n".encode("utf-8", "surrogateescape")
        if path is None or path != self.prefix + name:
            self._paths[len(self._ends)] = path
        self._ends.append(len(self._text))

    def _lines(self) -> Iterator[tuple[str | None, bytes]]:
        """(local path or None, the line's bytes) of each line."""
        start = 0
        for i, end in enumerate(self._ends):
            line = bytes(self._text[start:end])
            start = end
            if i in self._paths:
                yield self._paths[i], line
            else:
                yield self.prefix + line.partition(b"\0")[0].decode("utf-8", "surrogateescape"), line

    def digests(self, paths: frozenset[str]) -> dict[str, str]:
        """path -> the digest its line was hashed with, for each of `paths` listed."""
        if not paths:
            return {}
        return {path: line[:-1].partition(b"\0")[2].decode() for path, line in self._lines()
                if path is not None and path in paths}

    def hash(self, settled: dict[str, str] | None = None, unread: frozenset[str] = frozenset()) -> str:
        """`unread`: files a read error kept from being read whole; each adds a line no hash pass writes, its own
        line without its digest."""
        if not settled and not unread:  # every line as hashed at the start
            return hashlib.sha256(self._text).hexdigest()[:16]
        h = hashlib.sha256()
        for path, line in self._lines():
            # a file left unread: its bytes as far as read are in the rows, which a rerun compares
            # (still_unreadable.py); its digest is not (a tar streamed for its hash the first time is hashed up
            # front after: one file, two digests)
            digest = "left unread" if path in unread else (settled or {}).get(path) if path is not None else None
            h.update(line if digest is None else line[:line.index(b"\0") + 1] + f"{digest}\n".encode())
        for path in sorted(unread):
            h.update(f"read error\0{path}\n".encode("utf-8", "surrogateescape"))
        return h.hexdigest()[:16]


def content_listing_hash(source: str | Path, pending: frozenset[str] = frozenset(), keep: Listing | None = None) -> str:
    """Hash of (relative path, sha256 of the bytes) of every local source file (`sources.source_files`), and of
    (URL, size, content tag) of every shard at a URL. `pending`: local tars hashed while the reader streams them,
    standing for their stat stamp here (a provisional listing: first_read.py). `keep`: its lines recorded there."""
    s = str(source)
    base = listing_base(s)
    h = hashlib.sha256()
    prefix = os.path.join(os.path.abspath(base), "")
    if keep is not None:
        keep.prefix = prefix
    with FileHashes() as hashes:
        for f in tqdm(source_files(s), desc="source content hashes", unit="file", leave=False):
            name = _relative(str(f), prefix, base)
            try:
                # a name that is not UTF-8 (lone surrogates from the OS) cannot be a cache row: hashed uncached
                digest = stamp(f) if str(f) in pending else \
                    hashes.sha256(f) if printable(str(f)) == str(f) else file_sha256(f)
            except OSError as e:  # unreadable (permissions) or gone since the listing: its sample is quarantined
                digest = f"unreadable {e.errno}"  # when read; once readable the hash changes, and it is rendered
            h.update(f"{name}\0{digest}\n".encode("utf-8", "surrogateescape"))
            if keep is not None:
                keep.add(str(f), name, digest)
    if is_url(s):
        for line in remote_listing([u for u in remote_source_files(s) if is_url(u)]):
            h.update(f"{line}\n".encode())
            if keep is not None:
                keep.add(None, line)
    return h.hexdigest()[:16]


def listing_base(source: str | Path) -> Path:
    """The folder a source's files are named relative to, in the listing hash and (as its prefix) in the rows'
    `source` names: a folder source itself; the folder of a file source or of a brace list (so a brace list and its
    folder of shards hash the same)."""
    root = Path(source)
    return root.parent if is_shard_list(source) or not root.is_dir() else root


def _relative(path: str, prefix: str, base: Path) -> str:
    """`os.path.relpath(path, base)`, by slicing when `path` lies under `prefix` with no `..` (a file of a folder
    source): relpath normalises both paths on every call, a quarter of an unchanged million-file source's hash."""
    tail = path[len(prefix):]
    if path.startswith(prefix) and tail and "/../" not in f"/{tail}/" and os.sep == "/":
        return tail
    return os.path.relpath(path, base)
