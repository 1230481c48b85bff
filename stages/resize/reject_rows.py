"""A resize-bucket run's quarantine rows until its commit (`RejectRows`): text columns in Arrow buffers, a chunk
of rows at a time compressed (zstd: the paths and details repeat each other), not a Python dict per row (~700 B
each: ~700 MB for a source with 1M bad samples; ~40 B a row compressed: bench/resize_reject_memory.py). Nothing is
written before the commit, as before: a killed run judges its rejected samples again, and the commit's append
does not repeat a row.

A row is named by its number (`add`'s): the revivals change a held duplicate's detail (`set_detail`) or take its
row back (`drop`), applied when the rows are read (`table`), so the rows and their order are those the changes to
each row in place and the removals from one list left."""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from store.quarantine import BASE_COLUMNS, text_column

CHUNK = 4096  # rows held as dicts before they become columns: ~2.7 MB of dicts, a chunk's Python overhead negligible


class RejectRows:
    """Quarantine rows in the order added, as the text columns `store.quarantine` appends."""

    def __init__(self) -> None:
        self._recent: list[dict[str, Any]] = []  # the rows not yet in `_chunks`
        self._chunks: list[pa.Buffer] = []  # each an Arrow IPC stream of one table, zstd-compressed
        self._starts: list[int] = []  # each chunk's first row number
        self._flushed = 0  # rows in `_chunks`
        self._columns: dict[str, None] = dict.fromkeys(c for c in BASE_COLUMNS if c != "time")  # + in order met
        self._dropped: set[int] = set()
        self._details: dict[int, str] = {}  # row number -> its detail now, for rows in `_chunks`

    def add(self, row: dict[str, Any]) -> int:
        """Append `row`; its number."""
        self._columns.update(dict.fromkeys(row))
        self._recent.append(row)
        n = self._flushed + len(self._recent) - 1
        if len(self._recent) >= CHUNK:
            self._flush()
        return n

    def set_detail(self, n: int, detail: str) -> None:
        if n >= self._flushed:
            self._recent[n - self._flushed]["detail"] = detail
        else:
            self._details[n] = detail

    def drop(self, n: int) -> None:
        self._dropped.add(n)

    def __len__(self) -> int:
        return self._flushed + len(self._recent) - len(self._dropped)

    def first(self) -> dict[str, Any]:
        """The first row not dropped, as a dict (its `reason` and `detail` name why for a run that kept none)."""
        n = next(i for i in range(self._flushed + len(self._recent)) if i not in self._dropped)
        if n >= self._flushed:
            return dict(self._recent[n - self._flushed])
        i = bisect_right(self._starts, n) - 1
        row = _opened(self._chunks[i]).slice(n - self._starts[i], 1).to_pylist()[0]
        return {**row, "detail": self._details.get(n, row.get("detail"))}

    def table(self) -> pa.Table:
        """Every row not dropped, with its detail now: text columns in the order `store.quarantine.add_rows` gives
        them (the base columns but `time`, then the others as first met)."""
        self._flush()
        names = list(self._columns)
        if not self._chunks:
            return pa.table({c: pa.array([], pa.string()) for c in names})
        t = pa.concat_tables([_opened(c) for c in self._chunks], promote_options="permissive")
        t = pa.table({c: t.column(c) if c in t.column_names else pa.nulls(t.num_rows, pa.string()) for c in names})
        if self._details:
            t = t.set_column(names.index("detail"), "detail", self._changed_details(t.column("detail")))
        if self._dropped:
            keep = np.ones(t.num_rows, bool)
            keep[list(self._dropped)] = False
            t = t.filter(pa.array(keep))
        return t

    def _changed_details(self, detail: pa.ChunkedArray) -> pa.Array:
        where = np.zeros(len(detail), bool)
        where[list(self._details)] = True
        values = [self._details[n] for n in sorted(self._details)]  # replace_with_mask: in row order
        return pc.replace_with_mask(detail.combine_chunks(), pa.array(where), pa.array(values, pa.string()))

    def _flush(self) -> None:
        if not self._recent:
            return
        rows, names = self._recent, list(dict.fromkeys(c for r in self._recent for c in r))
        self._chunks.append(_compressed(pa.table({c: text_column([r.get(c) for r in rows]) for c in names})))
        self._starts.append(self._flushed)
        self._flushed += len(rows)
        self._recent = []


def _compressed(table: pa.Table) -> pa.Buffer:
    out = pa.BufferOutputStream()
    with pa.ipc.new_stream(out, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(table)
    return out.getvalue()


def _opened(chunk: pa.Buffer) -> pa.Table:
    return pa.ipc.open_stream(chunk).read_all()
