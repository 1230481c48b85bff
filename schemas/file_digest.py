"""The one whole-file hasher, for every layer: the store's shard checks and version names, the model-side file-hash
cache, evaluate's inputs. Torch-free and dependency-free, so the store and models alike import it."""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO


def file_sha256(f: str | os.PathLike | BinaryIO) -> str:
    """The sha256 (hex) of a file's bytes, read in chunks (stdlib `hashlib.file_digest`: no copy through Python, a
    GB-sized file never held whole): a path, or an open binary file from its position to its end."""
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    return hashlib.file_digest(f, "sha256").hexdigest()
