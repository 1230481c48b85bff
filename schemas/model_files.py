"""A base model folder's files, each with its size and sha256, in one order (by path parts): what its fingerprint
hashes (`fingerprint_of`; the walk is `models.loading.model_files`) and what an encoder records in its table's
schema (`attrs.model_files`), so a table refused by train/evaluate or re-encoded for another model names the
files that differ ("vae/diffusion_pytorch_model.safetensors: size 123 -> 456"), not only two fingerprints.

Recorded as a list of [path, size, sha256]: schema.json is written with sorted keys, so a mapping would come back
in string order, where "a.b/c" sorts before "a/b". Pure data: the walk (and the file-hash cache it reads) is in
models/."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable

MODEL_FILES_ATTR = "model_files"
SHOWN = 3  # files named in one line; the rest counted


@dataclass(frozen=True)
class ModelFile:
    path: str  # relative to the model folder, "/"-separated
    size: int
    sha256: str


def _parts(path: str) -> list[str]:
    return path.split("/")  # the walk's order


def fingerprint_of(files: Iterable[ModelFile]) -> str:
    """The model fingerprint of these files (names + contents, in the walk's order): as it has always been."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.path.encode())
        h.update(f.sha256.encode())
    return h.hexdigest()[:16]


def files_record(files: Iterable[ModelFile]) -> list[list[Any]]:
    """What a table records: [path, size, sha256] per file, in the walk's order."""
    return [[f.path, f.size, f.sha256] for f in files]


def recorded_files(recorded: Any) -> dict[str, tuple[int, str]] | None:
    """path -> (size, sha256) of a table's record; None when there is none (a table encoded before they were
    recorded) or it cannot be read (a damaged record: only the wording of an error depends on it)."""
    if not isinstance(recorded, list):
        return None
    try:
        return {str(p): (int(size), str(digest)) for p, size, digest in recorded}
    except (TypeError, ValueError):
        return None


def differing_files(recorded: Any, present: Iterable[ModelFile], most: int = SHOWN) -> str | None:
    """'files that differ: PATH: size 123 -> 456, PATH: sha256 1a2b3c4d -> 5e6f7a8b, PATH: not in --model and N
    more' (by path parts) between a table's record and the model now; None when the table records none or
    nothing differs (then the caller's line stays as it was: the two fingerprints alone)."""
    before = recorded_files(recorded)
    if before is None:
        return None
    now = {f.path: (f.size, f.sha256) for f in present}
    differ = []
    for path in sorted(before.keys() | now.keys(), key=_parts):
        was, new = before.get(path), now.get(path)
        if was == new:
            continue
        if new is None:
            differ.append(f"{path}: not in --model")
        elif was is None:
            differ.append(f"{path}: new in --model")
        elif was[0] != new[0]:
            differ.append(f"{path}: size {was[0]} -> {new[0]}")
        else:  # same size, other bytes
            differ.append(f"{path}: sha256 {was[1][:8]} -> {new[1][:8]}")
    if not differ:
        return None
    more = f" and {len(differ) - most} more" if len(differ) > most else ""
    return f"files that differ: {', '.join(differ[:most])}{more}"
