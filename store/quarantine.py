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
    data = {c: pa.array([_as_text(r.get(c, now if c == "time" else None)) for r in rows], pa.string()) for c in cols}
    new = pa.table(data)
    path = root / fmt.QUARANTINE
    with fmt.flock(root / fmt.STORE_LOCK):
        if path.is_file():
            new = pa.concat_tables([pq.read_table(path), new], promote_options="permissive")
        fmt.atomic_write_parquet(path, new)
    return len(rows)


def read(root: Path) -> pa.Table:
    path = root / fmt.QUARANTINE
    if not path.is_file():
        return pa.table({c: pa.array([], pa.string()) for c in BASE_COLUMNS})
    return pq.read_table(path)
