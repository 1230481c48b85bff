"""Source identity by content: the listing hash of a source is built from each file's relative path and the
sha256 of its bytes, so touching a file or copying the dataset elsewhere changes nothing. Hashes are cached by
(real path, size, mtime) so a rerun over an unchanged source reads no image bytes at all.

The cache is `models.file_hashes.FileHashes` (sqlite, one row per path): the same database file the model
fingerprints use.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tqdm import tqdm

from models.file_hashes import FileHashes

from stages.resize.sources import source_files


def content_listing_hash(source: str | Path) -> str:
    """Hash of (relative path, sha256 of the bytes) of every source file (`sources.source_files`)."""
    root = Path(source)
    base = root if root.is_dir() else root.parent
    h = hashlib.sha256()
    with FileHashes() as hashes:
        for f in tqdm(source_files(root), desc="source content hashes", unit="file", leave=False):
            h.update(f"{os.path.relpath(f, base)}\0{hashes.sha256(f)}\n".encode())
    return h.hexdigest()[:16]
