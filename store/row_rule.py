"""A per-row rule (a row's values as a dict -> bool, e.g. "does a fix change this stored sample?",
schemas/fixes.py) applied to whole tables: called once per distinct combination of the columns it reads, the
answer spread back over the rows in numpy. Row by row (`to_pylist()` of every row, one call each) it was
~80-100 s and 2.8 GB at 1M stored rows, now ~2.6 s (bench/fix_rules.py); a fix's columns take a handful of
distinct values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def codes(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """One int64 per row, equal iff the rows' values are (-1: null). Lists (nested too) by their items' codes;
    other types dictionary-encoded by Arrow."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())
        items = pa.array(codes(col.flatten()).astype(str))  # the row's items' codes joined: one string per row
        joined = pc.binary_join(pa.ListArray.from_arrays(offsets, items), ",")
        out = codes(joined)
        out[col.is_null().to_numpy(zero_copy_only=False)] = -1
        return out
    return pc.fill_null(pc.dictionary_encode(col).indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)


def per_distinct(table: pa.Table, rule: Callable[[dict[str, Any]], bool]) -> np.ndarray:
    """`rule` of every row of `table` (its columns: what the rule reads), as a bool array, calling it once per
    distinct row: the same answers as row by row for a rule that reads nothing but those columns."""
    if table.num_rows == 0:
        return np.zeros(0, bool)
    if table.num_columns == 0:  # (a table of no columns may count its rows: one answer for all)
        return np.full(table.num_rows, bool(rule({})))
    combined = np.zeros(table.num_rows, np.int64)
    for col in table.columns:  # one dense code per distinct row so far (1-D sorts: `unique(axis=0)` took ~2 s at 1M)
        c = codes(col) + 1
        _, combined = np.unique(combined * (int(c.max()) + 1) + c, return_inverse=True)
    _, first, inverse = np.unique(combined, return_index=True, return_inverse=True)
    answers = np.array([bool(rule(r)) for r in table.take(pa.array(first)).to_pylist()], bool)
    return answers[inverse.reshape(-1)]


class Declared(dict):
    """A row as a rule sees it: only the columns declared for it (those the table has). Reading another is a bug
    (evaluated per distinct value of the declared ones, the answer would be wrong), so it raises."""

    def __init__(self, values: dict[str, Any], declared: tuple[str, ...]) -> None:
        super().__init__(values)
        self.declared = declared

    def _check(self, name: object) -> None:
        if name not in self.declared:
            raise KeyError(f"a row rule read column {name!r}, not among those declared for it {self.declared}; "
                           "declare it with the rule (Fixes.reads, RowRule.columns)")

    def __getitem__(self, name: str) -> Any:
        self._check(name)
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:
        self._check(name)
        return super().get(name, default)

    def __contains__(self, name: object) -> bool:
        self._check(name)
        return super().__contains__(name)


@dataclass(frozen=True)
class RowRule:
    """A rule over a row's `columns` (those the table lacks are left out of the dict, as a meta dict lacks them)."""

    rule: Callable[[dict[str, Any]], bool]
    columns: tuple[str, ...]

    def __call__(self, rows: pa.Table) -> np.ndarray:
        """Which rows the rule holds for."""
        return per_distinct(rows.select([c for c in self.columns if c in rows.column_names]),
                            lambda r: self.rule(Declared(r, self.columns)))


@dataclass(frozen=True)
class ColumnRule:
    """A rule over whole columns at once (`rule(rows)`: one bool per row), for columns of as many distinct values as
    rows (a caption), where `RowRule` would call Python once per row."""

    rule: Callable[[pa.Table], np.ndarray]
    columns: tuple[str, ...]

    def __call__(self, rows: pa.Table) -> np.ndarray:
        return np.asarray(self.rule(rows.select([c for c in self.columns if c in rows.column_names])), bool)


@dataclass(frozen=True)
class AnyOf:
    """Rows any of `rules` holds for (the fixes made since a revision: each asked over its own columns)."""

    rules: tuple[Any, ...]

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c for r in self.rules for c in r.columns))

    def __call__(self, rows: pa.Table) -> np.ndarray:
        out = np.zeros(rows.num_rows, bool)
        for r in self.rules:
            out |= r(rows)
        return out
