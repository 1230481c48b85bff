"""Set by `pipeline store repair` while it runs a producing stage: the lineage of the version being repaired.
A stage whose own lineage differs (other config, model, code) would not resume the repair version but re-encode
everything into another one, so it stops at once and says which part differs - unless the version repaired was
made by an earlier revision of this very stage and settings (a fix made since, schemas/fixes.py): the samples the
stage recomputes are this revision's, so it writes them under its own lineage (`supersede`), into a version that
recomputes what the fixes change too and carries the rest; the next run then reuses every sample."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

from schemas.errors import UserError
from schemas.lineage import Lineage


@dataclass
class Repairing:
    lineage: Lineage  # the version repaired's
    superseded_by: Lineage | None = None  # the stage's own, when it is a later revision of `lineage` (`supersede`)


_REPAIRING: ContextVar[Repairing | None] = ContextVar("repairing", default=None)


@contextmanager
def expecting(lineage: Lineage) -> Iterator[Repairing]:
    token = _REPAIRING.set(repairing := Repairing(lineage))
    try:
        yield repairing
    finally:
        _REPAIRING.reset(token)


def expected() -> Lineage | None:
    """The lineage of the version being repaired (None outside a repair)."""
    r = _REPAIRING.get()
    return None if r is None else r.lineage


def active() -> bool:
    """True while `pipeline store repair` runs a producing stage."""
    return _REPAIRING.get() is not None


def supersede(lineage: Lineage) -> None:
    """The stage found the version repaired to be an earlier revision of its own lineage (`lineage`): it writes
    under `lineage` instead (a new version; the repair takes it for the repaired one)."""
    r = _REPAIRING.get()
    if r is not None:
        r.superseded_by = lineage


def check(lineage: Lineage, table: str) -> None:
    r = _REPAIRING.get()
    if r is None or lineage in (r.lineage, r.superseded_by):
        return
    a, b = r.lineage.to_dict(), lineage.to_dict()
    diff = [f"{k} {a[k]!r} -> {b[k]!r}" for k in sorted(a) if a.get(k) != b.get(k)]
    raise UserError(f"cannot repair table '{table}' with these settings: {'; '.join(diff)}. Pass the --config and "
                    "--model (and --source) it was built with")
