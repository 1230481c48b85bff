"""`images` rows holding the same pictures: the same target and controls (`source_hashes`, their files' sha256s,
in order) under another key - the pair under another caption. The one rule resize-bucket's `val_sharing` (val
samples whose pictures a train sample has) and evaluate's `trained_val` (val samples whose pictures the run
trained on) count by (a stage may not import another).

`control_is_target`: a row whose control is its target (an identity edit), resize-bucket's summary line.

Vectorised Arrow over that one column: no row in Python (a million rows in ~0.3 s)."""

from __future__ import annotations

from typing import Any

COLUMN = "source_hashes"


def has_picture_hashes(rows: Any) -> bool:
    """Does `rows` (an Arrow table) hold `source_hashes` as lists of hashes (a table from before the column, or
    one merged permissively from indexes that lacked it, may not)?"""
    import pyarrow as pa

    if COLUMN not in rows.column_names:
        return False
    kind = rows.schema.field(COLUMN).type
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def sharing_pictures(rows: Any, others: Any) -> Any:
    """For each row of `rows`: does a row of `others` hold its pictures (the same `source_hashes` list)? False for
    a row without hashes (null or empty: `is_in` matches a null with a null, which counted every such row as
    sharing), and for every row where either table lacks the column. Only the rows of `others` whose target (first
    hash) a row of `rows` has are joined: all of them joined cost ~1.5 s and ~450 MB more at a million rows."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not (has_picture_hashes(rows) and has_picture_hashes(others)):
        return pa.array([False] * rows.num_rows, pa.bool_())
    mine, theirs = rows.column(COLUMN), others.column(COLUMN)
    has = pc.fill_null(pc.greater(pc.list_value_length(mine), 0), False)
    theirs = pc.filter(theirs, pc.fill_null(pc.greater(pc.list_value_length(theirs), 0), False))
    targets = _flat(pc.list_element(pc.filter(mine, has), 0))  # `list_element` fails on an empty list: filtered
    candidates = pc.filter(theirs, pc.is_in(pc.list_element(theirs, 0), value_set=targets))
    seen = _flat(pc.binary_join(candidates, ""))
    return pc.and_(has, pc.fill_null(pc.is_in(pc.binary_join(mine, ""), value_set=seen), False))


def _flat(values: Any) -> Any:
    """One Arrow array (`is_in`'s value_set takes no chunked one)."""
    import pyarrow as pa

    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def control_is_target(rows: Any) -> Any:
    """For each row of `rows` (an Arrow table), a numpy bool: is one of its controls its target, the same bytes (a
    `source_hashes` entry after the first equal to the first)? An identity edit: a column mapped wrong, or the
    target copied as control. False for a row without hashes, and for every row where the table lacks the column.
    Each hash is compared with its row's first and the matches counted per row: the target matches itself once."""
    import numpy as np
    import pyarrow.compute as pc

    out = np.zeros(rows.num_rows, bool)
    if not has_picture_hashes(rows):
        return out
    lists = _flat(rows.column(COLUMN))
    has = pc.fill_null(pc.greater(pc.list_value_length(lists), 0), False)
    if not pc.all(has).as_py():
        lists = pc.filter(lists, has)  # `list_element` fails on an empty list: filtered
    parents = pc.list_parent_indices(lists)
    same = pc.equal(pc.list_flatten(lists), pc.take(pc.list_element(lists, 0), parents))
    same = pc.fill_null(same, False).to_numpy(zero_copy_only=False)
    matches = np.bincount(parents.to_numpy()[same], minlength=len(lists))
    out[has.to_numpy(zero_copy_only=False)] = matches >= 2
    return out
