"""Source identity by content: the listing hash of a source is built from each file's relative path and the
sha256 of its bytes, so touching a file or copying the dataset elsewhere changes nothing. Hashes are cached by
(real path, size, mtime) so a rerun over an unchanged source reads no image bytes at all.

Hand-written rather than a library: the cache is one JSON file (like the model fingerprint cache).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tqdm import tqdm

from stages.resize.sources import source_files

CACHE_NAME = "source-hashes.json"


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qwen-edit-pipeline" / CACHE_NAME


def _load_cache(path: Path) -> dict[str, str]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(path: Path, cache: dict[str, str]) -> None:
    try:  # a cache only: failing to write it costs a re-hash next time, nothing else
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, path)
    except OSError:
        pass


def file_sha256(f: Path, cache: dict[str, str]) -> str:
    real = os.path.realpath(f)
    st = os.stat(real)
    slot = f"{real}|{st.st_size}|{st.st_mtime_ns}"
    digest = cache.get(slot)
    if digest is None:
        h = hashlib.sha256()
        with open(real, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
        digest = cache[slot] = h.hexdigest()
    return digest


def content_listing_hash(source: str | Path) -> str:
    """Hash of (relative path, sha256 of the bytes) of every source file (`sources.source_files`)."""
    root = Path(source)
    base = root if root.is_dir() else root.parent
    cache_path = _cache_file()
    cache = _load_cache(cache_path)
    known = len(cache)
    h = hashlib.sha256()
    for f in tqdm(source_files(root), desc="source content hashes", unit="file", leave=False):
        h.update(f"{os.path.relpath(f, base)}\0{file_sha256(f, cache)}\n".encode())
    if len(cache) != known:
        _save_cache(cache_path, cache)
    return h.hexdigest()[:16]
