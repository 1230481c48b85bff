"""Small JSON records a caller keeps beside a complete version (`<table>/v<N>.note-<name>.json`): what it learnt
while writing that version and wants on its next run, e.g. which source files the rows came from, by hash. The
store does not read their contents; it ties each to the version's bytes (`Store.version_id`), so a record of a
version deleted and rebuilt under the same number is not trusted, and `store gc` removes it with its version.

A cache, not data: a missing, damaged or foreign record reads as none (the caller then does the work again), and a
store that cannot be written to keeps none. Not copied to a store URL.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.errors import UserError
from store import format as fmt

if TYPE_CHECKING:
    from store import Store

_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,40}")


def note_path(root: Path, table: str, version: int, name: str) -> Path:
    if not _NAME.fullmatch(name):
        raise ValueError(f"version note name {name!r}: lowercase letters, digits and '-'")
    return root / table / f"v{version}.note-{name}.json"


def notes_of(root: Path, table: str, version: int) -> list[Path]:
    """Every note beside a version (gc removes them with it)."""
    folder = root / table
    return sorted(folder.glob(f"v{version}.note-*.json")) if folder.is_dir() else []


def read_note(store: Store, table: str, version: int, name: str, version_id: str | None = None) -> Any:
    """The value written for this very version (same manifest bytes), else None. `version_id`: the version's
    `Store.version_id` where the caller holds it (its reader's view hashed the manifest: not hashed again)."""
    path = note_path(store.root, table, version, name)
    if not path.is_file():
        return None
    try:
        rec = fmt.read_json(path, "version note")
        return rec.get("value") if rec.get("version_id") == (version_id or store.version_id(table, version)) else None
    except (UserError, AttributeError, OSError):  # damaged or hand-edited: as none
        return None


def write_note(store: Store, table: str, version: int, name: str, value: Any, version_id: str | None = None) -> None:
    """Record `value` (JSON) beside the complete version, atomically (a kill leaves the old record or the new)."""
    try:
        fmt.atomic_write_json(note_path(store.root, table, version, name),
                              {"version_id": version_id or store.version_id(table, version), "value": value})
    except OSError:  # a read-only store: nothing remembered, the next run does the work again
        pass
