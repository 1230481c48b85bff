"""sha256 of files' bytes, remembered by (real path, size, mtime) in a JSON file under the user cache folder, so
unchanged multi-GB model weights or a dataset's images are read once, not on every stage run.

Used by the model fingerprints (`models.loading`) and by the source identity of resize-bucket
(`stages.resize.content`). Hand-written: a dict in one JSON file is all it needs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


class FileHashes:
    """`with FileHashes("name.json") as hashes: hashes.sha256(path)`; new entries are saved when the block ends."""

    def __init__(self, cache_name: str) -> None:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        self.path = Path(base) / "qwen-edit-pipeline" / cache_name
        self.cache: dict[str, str] = {}

    def __enter__(self) -> "FileHashes":
        try:
            self.cache = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.cache = {}
        self._known = len(self.cache)
        return self

    def __exit__(self, *exc: object) -> None:
        if len(self.cache) == self._known:
            return
        try:  # a cache only: failing to write it costs a re-hash next time, nothing else
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(self.cache))
            os.replace(tmp, self.path)
        except OSError:
            pass

    def sha256(self, f: str | Path) -> str:
        real = os.path.realpath(f)
        st = os.stat(real)
        slot = f"{real}|{st.st_size}|{st.st_mtime_ns}"
        if slot not in self.cache:
            h = hashlib.sha256()
            with open(real, "rb") as fh:
                while chunk := fh.read(8 << 20):
                    h.update(chunk)
            self.cache[slot] = h.hexdigest()
        return self.cache[slot]
