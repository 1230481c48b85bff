"""The manifest side of a table reader (store/reader.py `TableReader`, which adds the samples' bytes): lookups by
key, meta and img_shapes by key, manifest columns, and the order of rows a rank reads in an epoch - all answered
from the version's manifest (store/manifest_view.py), with no shard opened. `split_rows` serves a bare manifest
column as well (features/open.py)."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import UserError
from schemas.img_shapes import ImgShape
from store.manifest import RESERVED_COLUMNS
from store.manifest_view import ManifestView
from store.partition import epoch_positions


class ReaderManifest:
    """Keys, meta, columns and row order of one table version, over its `ManifestView` (`view`)."""

    def __init__(self, view: ManifestView) -> None:
        self.view = view
        self.dir, self.table, self.version = view.dir, view.table, view.version

    schema = property(lambda self: self.view.schema)
    checksummed = property(lambda self: self.view.checksummed)
    key_array = property(lambda self: self.view.keys.array)
    keys_sorted = property(lambda self: self.view.keys.sorted)
    is_v1 = property(lambda self: self.view.is_v1)
    manifest = property(lambda self: self.view.manifest)

    # ------------------------------------------------------------ keys, meta, columns

    def column(self, name: str) -> pa.Array:
        return self.view.column(name)

    def has_column(self, name: str) -> bool:
        return self.view.has_column(name)

    def __len__(self) -> int:
        return len(self.view)

    def __contains__(self, key: str) -> bool:
        return self.view.keys.row_of(key) is not None

    def row_of(self, key: str) -> int | None:
        return self.view.keys.row_of(key)

    def rows_of_keys(self, keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """Each key's row number, -1 where the table lacks it (store/key_index.py), for whole columns of keys: take
        another table's rows' values from this one with `column(name).take(...)`, not `meta(key)` row by row."""
        return self.view.keys.rows_of_keys(keys)

    def keys(self) -> list[str]:
        return list(self.view.keys.as_list())

    def meta_columns(self) -> list[str]:
        return self.view.meta_columns()

    def meta(self, key: str) -> dict[str, Any]:
        return self.view.meta_at(self.view.keys.index(key))

    def cells(self, key: str, columns: Iterable[str]) -> dict[str, Any]:
        """The named meta columns of one sample (those the table has; a v1 table's img_shapes derived, as `meta`
        gives them): a walk that needs a few of them (encode's writes, its quarantine rows) parses only those.
        `meta` turns every meta column of the row into Python objects: ~480 us a sample at 1M rows (13 columns of
        `images`), ~12 us for one."""
        columns, i = tuple(columns), self.view.keys.index(key)
        out = {c: self.view.cell(c, i) for c in columns if c in self.view.names and c not in RESERVED_COLUMNS}
        if self.view.is_v1 and "img_shapes" in columns:
            out["img_shapes"] = [list(s) for s in self.view.img_shapes_at(i)]
        return out

    def meta_of(self, keys: Iterable[str], columns: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The named meta columns of a few keys (e.g. evaluate's captions), reading only those rows and columns and
        keeping nothing (`ManifestView.rows_at`); `meta(key)` is for walks over the table: it keeps every meta
        column parsed. A key the table lacks is a UserError, as in `meta`."""
        rows = {k: self.view.keys.index(k) for k in keys}
        got = self.view.rows_at(rows.values(), columns)
        return {k: got[i] for k, i in rows.items()}

    def img_shapes(self, key: str) -> list[ImgShape]:
        return self.view.img_shapes_at(self.view.keys.index(key))

    def img_shapes_at(self, i: int) -> list[ImgShape]:
        return self.view.img_shapes_at(i)

    # ------------------------------------------------------------ row order

    def rows_of(self, split: str | None) -> np.ndarray:
        """Row numbers of one split (every row for None)."""
        if split is None:
            return np.arange(len(self), dtype=np.int64)
        return split_rows(self.column("split") if self.has_column("split") else None, split,
                          f"table '{self.table}' v{self.version} ({self.dir})")

    def by_shard(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`rows` grouped by shard - shards in name order, rows in row order within one - and each group's size
        (no empty groups): the stored order of `iter_keys`, as numbers."""
        idx, names = self.view.samples.shard_numbers()
        rank_of = {name: i for i, name in enumerate(sorted(set(names)))}
        group = np.asarray([rank_of[n] for n in names], dtype=np.int64)[idx[rows]] if len(rows) else \
            np.zeros(0, np.int64)
        order = np.lexsort((rows, group))
        sizes = np.bincount(group, minlength=len(rank_of))
        return rows[order], sizes[sizes > 0]

    def shard_groups(self, split: str | None = None) -> list[list[str]]:
        """Keys grouped by shard (in shard order, then key order), optionally only one split."""
        rows, sizes = self.by_shard(self.rows_of(split))
        keys = self.key_array.take(pa.array(rows)).to_pylist()
        ends = np.cumsum(sizes).tolist()
        return [keys[a:b] for a, b in zip([0, *ends[:-1]], ends)]

    def iter_keys(
        self, split: str | None = None, rank: int = 0, world_size: int = 1,
        seed: int | None = None, epoch: int = 0, buffer_size: int = 1024,
    ) -> list[str]:
        """This rank's keys for one epoch (see store.partition): disjoint across ranks, nothing lost."""
        return self.epoch_keys(self.rows_of(split), rank, world_size, seed, epoch, buffer_size)

    def epoch_keys(
        self, rows: np.ndarray, rank: int = 0, world_size: int = 1,
        seed: int | None = None, epoch: int = 0, buffer_size: int = 1024,
    ) -> list[str]:
        """`iter_keys` of the given rows: the order is worked out on row numbers and only this rank's share
        becomes str keys (every rank's would be ~1M str and lists of them per rank at 1M samples)."""
        rows, sizes = self.by_shard(np.asarray(rows, dtype=np.int64))
        mine = rows[epoch_positions(sizes, rank, world_size, seed, epoch, buffer_size)]
        return self.key_array.take(pa.array(mine)).to_pylist()


def split_rows(column: pa.Array | pa.ChunkedArray | None, split: str, table: str) -> np.ndarray:
    """Row numbers of one split from a table's `split` column (None: the table has none, `table` names it), for a
    reader and for a bare manifest alike."""
    if column is None:
        raise UserError(f"{table} has no split column; rebuild it with the current code")
    return np.flatnonzero(pc.fill_null(pc.equal(column, split), False).to_numpy(zero_copy_only=False))
