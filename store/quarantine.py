"""`STORE/quarantine.parquet`: rejected inputs, one row each (key, source, stage, reason, detail, ...).

Appends are read-modify-write under the store lock and land via temp + rename: never a torn file.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.errors import UserError
from store import format as fmt

REQUIRED = ("source", "stage", "reason")
BASE_COLUMNS = ("key", "source", "stage", "reason", "detail", "time")


def _as_text(v: Any) -> str | None:
    if v is None or isinstance(v, str):
        return v
    return json.dumps(v, sort_keys=True, default=str)


def add_rows(root: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Append rows; a row equal in every column but `time` to one already recorded (an interrupted run that
    retried the sample, a rerun over an older version) is not repeated. Returns how many were added."""
    rows = list(rows)
    if not rows:
        return 0
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    cols: dict[str, None] = dict.fromkeys(BASE_COLUMNS)
    for i, r in enumerate(rows):
        missing = [c for c in REQUIRED if not r.get(c)]
        if missing:
            raise UserError(f"quarantine row {i} lacks {missing}: {r!r}")
        cols.update(dict.fromkeys(r))
    # Every column is text, so appends from different stages never clash on types.
    identity = [c for c in cols if c != "time"]
    path = root / fmt.QUARANTINE
    with fmt.flock(root / fmt.STORE_LOCK):
        old = pq.read_table(path) if path.is_file() else None
        seen: set[tuple[str | None, ...]] = set()
        if old is not None and old.num_rows:
            have = {c: old.column(c).to_pylist() if c in old.column_names else [None] * old.num_rows for c in identity}
            seen = set(zip(*(have[c] for c in identity)))
        fresh = []
        for r in rows:
            ident = tuple(_as_text(r.get(c)) for c in identity)
            if ident not in seen:
                seen.add(ident)
                fresh.append(r)
        if not fresh:
            return 0
        data = {c: pa.array([_as_text(r.get(c, now if c == "time" else None)) for r in fresh], pa.string()) for c in cols}
        new = pa.table(data)
        if old is not None:
            new = pa.concat_tables([old, new], promote_options="permissive")
        fmt.atomic_write_parquet(path, new)
    return len(fresh)


def read(root: Path) -> pa.Table:
    path = root / fmt.QUARANTINE
    if not path.is_file():
        return pa.table({c: pa.array([], pa.string()) for c in BASE_COLUMNS})
    return pq.read_table(path)
