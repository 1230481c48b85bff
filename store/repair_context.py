"""Set by `pipeline store repair` while it runs a producing stage: the lineage of the version being repaired.
A stage whose own lineage differs (other config, model, code) would not resume the repair version but re-encode
everything into another one, so it stops at once and says which part differs."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

from schemas.errors import UserError
from schemas.lineage import Lineage

_EXPECTED: ContextVar[Lineage | None] = ContextVar("repair_expected_lineage", default=None)


@contextmanager
def expecting(lineage: Lineage) -> Iterator[None]:
    token = _EXPECTED.set(lineage)
    try:
        yield
    finally:
        _EXPECTED.reset(token)


def expected() -> Lineage | None:
    """The lineage of the version being repaired (None outside a repair)."""
    return _EXPECTED.get()


def active() -> bool:
    """True while `pipeline store repair` runs a producing stage."""
    return _EXPECTED.get() is not None


def check(lineage: Lineage, table: str) -> None:
    want = _EXPECTED.get()
    if want is None or want == lineage:
        return
    a, b = want.to_dict(), lineage.to_dict()
    diff = [f"{k} {a[k]!r} -> {b[k]!r}" for k in sorted(a) if a.get(k) != b.get(k)]
    raise UserError(f"cannot repair table '{table}' with these settings: {'; '.join(diff)}. Pass the --config and "
                    "--model (and --source) it was built with")
