"""Records written by a newer release of pipeline: intact, only not this release's to read.

Stores, run folders and LoRAs outlive the release that wrote them, so every versioned record a reader checks
(store.json, a version's checksums.json and schema.json, a checkpoint's resume.json, a folder's sealed checksums)
tells "a newer release wrote this" apart from "damaged": a user told "damaged" repairs, sets aside or deletes good
data. The one rule: a record whose bytes are shown intact (sealed, or checked against a sealed record) and that
holds a format above what this code reads - or, where a caller names the fields it knows, a field it does not
know under the format it reads - is `WrittenByNewer`. A record that cannot show its bytes are as written proves
nothing: its higher number may be a flipped bit ('1' and '3' differ in one), so there the caller's damage
verdict stands.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from schemas.errors import UserError


class WrittenByNewer(UserError):
    """Never damage: whatever repairs, rewrites, sets aside or records damage lets it through (a plain
    `except UserError` that treats what it catches as damage must re-raise this first)."""


def newer_than_this(record: Any, reads_up_to: int, *, intact: bool, key: str = "format",
                    known: Collection[str] | None = None) -> str | None:
    """What in `record` says a newer release wrote it ("format 3, this one reads up to 2"), or None. `intact`:
    its bytes are shown as written (else None, see the module doc). `known`: the fields this code reads, for
    records whose releases add fields with defaults under one format: an unknown one in a record of format
    `reads_up_to` is a newer release's too. A record without `key` is format 1 (written before it was recorded)."""
    if not intact or not isinstance(record, dict):
        return None
    found = record.get(key, 1)
    if isinstance(found, int) and not isinstance(found, bool) and found > reads_up_to:
        return f"format {found}, this one reads up to {reads_up_to}"
    unknown = sorted(set(record) - set(known)) if known is not None and found == reads_up_to else []
    if unknown:
        named = f"field{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}"
        return f"format {found} with {named} this one does not know"
    return None


def refuse_newer(where: str, record: Any, reads_up_to: int, *, intact: bool, key: str = "format",
                 known: Collection[str] | None = None, then: str = "") -> None:
    """Raise `WrittenByNewer` ("<where> was written by a newer version of pipeline (...): upgrade<then>") when
    `newer_than_this` finds the record a newer release's."""
    newer = newer_than_this(record, reads_up_to, intact=intact, key=key, known=known)
    if newer is not None:
        raise WrittenByNewer(f"{where} was written by a newer version of pipeline ({newer}): upgrade{then}")
