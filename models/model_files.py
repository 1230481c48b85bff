"""A base model folder's files, each with its size and sha256, in one order (by path parts): what its fingerprint
hashes (`models.loading.model_fingerprint`) and what an encoder records in its table's schema (`attrs.model_files`),
so a table refused or re-encoded for another model names the files that differ, not only two fingerprints.

Recorded as a list of [path, size, sha256] (schema.json is written with sorted keys: a mapping would come back in
string order, where "a.b/c" sorts before "a/b"), from the same walk as the fingerprint (the file-hash cache:
nothing is read again)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable

MODEL_FILES_ATTR = "model_files"


@dataclass(frozen=True)
class ModelFile:
    path: str  # relative to the model folder, "/"-separated
    size: int
    sha256: str


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


def differing_files(recorded: Any, present: Iterable[ModelFile], most: int = 3) -> str | None:
    """'files that differ: PATH (changed), PATH (only in --model), ... and N more' between a table's record and
    the model now; None when the table records none (encoded before they were recorded) or nothing differs."""
    if not isinstance(recorded, list):
        return None
    try:
        before = {str(p): (int(size), str(digest)) for p, size, digest in recorded}
    except (TypeError, ValueError):  # a damaged record: only the wording depends on it
        return None
    now = {f.path: (f.size, f.sha256) for f in present}
    parts = lambda p: p.split("/")  # noqa: E731 - the walk's order
    changed = [(p, "changed" if p in now else "not in --model") for p in sorted(before, key=parts)
               if before[p] != now.get(p)]
    changed += [(p, "new in --model") for p in sorted(now.keys() - before.keys(), key=parts)]
    if not changed:
        return None
    changed.sort(key=lambda c: parts(c[0]))
    shown = ", ".join(f"{p} ({why})" for p, why in changed[:most])
    more = f" and {len(changed) - most} more" if len(changed) > most else ""
    return f"files that differ: {shown}{more}"
