"""Reading one table version: mmap fast path (tensors sliced by manifest offsets, no tar parsing, no copy),
random access by key, meta, img_shapes (derived on the fly for schema v1), rank/epoch iteration order.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from schemas.errors import UserError
from schemas.img_shapes import ImgShape, img_shapes_from_v1
from schemas.table import KNOWN_SCHEMA_VERSIONS, SCHEMA_V1, TableSchema
from store import format as fmt
from store.manifest import LOCATING_COLUMNS
from store.partition import epoch_order

log = logging.getLogger("store")

V1_PIXEL_COLUMNS = ("height", "width")


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise UserError(f"unknown tensor dtype {name!r} in manifest")
    return dt


def read_schema(vdir: Path) -> TableSchema:
    raw = fmt.read_json(vdir / fmt.SCHEMA_JSON, "schema.json")
    found = raw.get("schema_version") if isinstance(raw, dict) else None
    if found not in KNOWN_SCHEMA_VERSIONS:
        raise UserError(f"{vdir / fmt.SCHEMA_JSON}: expected schema version one of {KNOWN_SCHEMA_VERSIONS}, "
                        f"found {found!r}; use a pipeline release that reads it")
    return TableSchema.from_dict(raw)


DEFAULT_MAX_OPEN_SHARDS = 256  # mapped shards kept open per reader (LRU); the kernel allows ~65k maps a process


def _strictly_increasing(keys: pa.Array) -> bool:
    """Manifests are sorted by key: strictly increasing keys are unique (a vectorised check, no hash set)."""
    if len(keys) < 2:
        return True
    return bool(pc.all(pc.less(keys.slice(0, len(keys) - 1), keys.slice(1))).as_py())


class TableReader:
    def __init__(self, vdir: Path, table: str, version: int, max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS) -> None:
        self.dir, self.table, self.version = vdir, table, version
        self._dir_str = str(vdir)
        if not fmt.is_complete(vdir):
            raise UserError(f"table '{table}' v{version} at {vdir} is incomplete (no {fmt.MANIFEST}); "
                            "rerun the stage that writes it to resume")
        self.schema = read_schema(vdir)
        path = vdir / fmt.MANIFEST
        names = pq.read_schema(path).names
        missing = sorted(LOCATING_COLUMNS - set(names))
        if missing:
            raise UserError(f"{path}: missing columns {missing} (see docs/store-format.md)")
        self._names = list(names)
        self._full: pa.Table | None = None
        # Opening reads the key column only; every other column is read on first use, alone (`column`), and
        # kept as an Arrow array: a million-sample table never becomes a million Python dicts.
        self.key_array: pa.StringArray = pq.read_table(path, columns=["key"]).column("key").combine_chunks()
        self.keys_sorted = _strictly_increasing(self.key_array)
        if not self.keys_sorted and pc.count_distinct(self.key_array).as_py() != len(self.key_array):
            raise UserError(f"{path}: duplicate keys; run `pipeline store verify` on the store")
        self._key_list: list[str] | None = None
        self._row_of: dict[str, int] | None = None
        self._cols: dict[str, list[Any]] = {}
        self._arrays: dict[str, pa.Array] = {}
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self.max_open_shards = max(1, int(max_open_shards))
        self.is_v1 = self.schema.schema_version == SCHEMA_V1
        if self.is_v1:
            lacking = [c for c in V1_PIXEL_COLUMNS if c not in names]
            if lacking:
                raise UserError(f"{path}: schema v1 table lacks pixel columns {lacking}")
            log.warning("table '%s' v%d uses schema v1: img_shapes derived from pixel sizes; "
                        "run `pipeline migrate v1-to-v2 STORE` to upgrade", table, version)

    # ------------------------------------------------------------ basics

    @property
    def manifest(self) -> pa.Table:
        """The whole manifest (every column), read on first use."""
        if self._full is None:
            self._full = pq.read_table(self.dir / fmt.MANIFEST)
        return self._full

    def column(self, name: str) -> pa.Array:
        """One manifest column as a single Arrow array, read from the parquet file on first use."""
        if name not in self._arrays:
            if self._full is not None:
                col = self._full.column(name)
            else:
                if name not in self._names:
                    raise KeyError(name)
                col = pq.read_table(self.dir / fmt.MANIFEST, columns=[name],
                                    read_dictionary=["shard"] if name == "shard" else None).column(name)
            self._arrays[name] = col.combine_chunks()
        return self._arrays[name]

    def has_column(self, name: str) -> bool:
        return name in self._names

    @property
    def _keys(self) -> list[str]:
        if self._key_list is None:
            self._key_list = self.key_array.to_pylist()
        return self._key_list

    @property
    def _row(self) -> dict[str, int]:
        """key -> row, built on the first lookup by key (the trainer addresses rows by index instead)."""
        if self._row_of is None:
            self._row_of = {k: i for i, k in enumerate(self._keys)}
        return self._row_of

    def __len__(self) -> int:
        return len(self.key_array)

    def __contains__(self, key: str) -> bool:
        return key in self._row

    def keys(self) -> list[str]:
        return list(self._keys)

    def _col(self, name: str) -> list[Any]:
        if name not in self._cols:
            self._cols[name] = self.column(name).to_pylist()
        return self._cols[name]

    def _cell(self, name: str, i: int) -> Any:
        """One value, without turning the whole column into Python objects."""
        if name in self._cols:
            return self._cols[name][i]
        return self.column(name)[i].as_py()

    def _index(self, key: str) -> int:
        try:
            return self._row[key]
        except KeyError:
            raise UserError(f"key {key} not in table '{self.table}' v{self.version}") from None

    def meta_columns(self) -> list[str]:
        return [c for c in self._names if c not in LOCATING_COLUMNS]

    def meta(self, key: str) -> dict[str, Any]:
        i = self._index(key)
        out = {c: self._col(c)[i] for c in self.meta_columns()}
        if self.is_v1:
            out["img_shapes"] = [list(s) for s in self.img_shapes(key)]
        return out

    def img_shapes(self, key: str) -> list[ImgShape]:
        return self.img_shapes_at(self._index(key))

    def img_shapes_at(self, i: int) -> list[ImgShape]:
        if self.is_v1:
            row = {c: self._cell(c, i) for c in ("height", "width", "control_height", "control_width")
                   if c in self._names}
            return img_shapes_from_v1(row)
        return [tuple(s) for s in self._cell("img_shapes", i)]  # type: ignore[misc]

    # ------------------------------------------------------------ bytes

    def shard_map(self, shard: str) -> mmap.mmap:
        """Private (copy-on-write) map: tensors are writable views, and a write never reaches the file.

        At most `max_open_shards` maps stay referenced here (least recently used dropped first): a million-sample
        store has tens of thousands of shards. A dropped map whose tensors are still alive closes when they go."""
        m = self._maps.get(shard)
        if m is not None:
            self._maps.move_to_end(shard)
            return m
        with open(os.path.join(self._dir_str, shard), "rb") as f:  # os.path: pathlib costs more than the map
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._maps[shard] = m
        while len(self._maps) > self.max_open_shards:
            _, old = self._maps.popitem(last=False)
            try:
                old.close()
            except BufferError:  # tensors still view it
                pass
        return m

    def tensors(self, key: str) -> dict[str, torch.Tensor]:
        return self.tensors_at(self._index(key))

    def tensors_at(self, i: int) -> dict[str, torch.Tensor]:
        m = self.shard_map(self._cell("shard", i))
        out = {}
        for t in self._cell("tensors", i):
            dt = torch_dtype(t["dtype"])
            n = t["nbytes"] // dt.itemsize
            if n == 0:  # frombuffer rejects count=0; an empty tensor (e.g. no control views) is legal
                out[t["name"]] = torch.empty(t["shape"], dtype=dt)
                continue
            out[t["name"]] = torch.frombuffer(m, dtype=dt, count=n, offset=t["offset"]).view(t["shape"])
        return out

    def files(self, key: str) -> dict[str, bytes]:
        i = self._index(key)
        m = self.shard_map(self._cell("shard", i))
        return {f["name"]: m[f["offset"] : f["offset"] + f["nbytes"]] for f in self._cell("files", i)}

    def get(self, key: str) -> dict[str, Any]:
        return {"key": key, "meta": self.meta(key), "tensors": self.tensors(key), "files": self.files(key)}

    def shard_paths(self) -> list[Path]:
        return [self.dir / s for s in dict.fromkeys(self._col("shard"))]

    # ------------------------------------------------------------ iteration

    def shard_groups(self, split: str | None = None) -> list[list[str]]:
        """Keys grouped by shard (in shard order, then key order), optionally only one split."""
        splits = self._col("split") if split is not None and "split" in self._names else None
        if split is not None and splits is None:
            raise UserError(f"table '{self.table}' v{self.version} has no split column")
        groups: dict[str, list[str]] = {}
        for i, (k, s) in enumerate(zip(self._keys, self._col("shard"))):
            if splits is None or splits[i] == split:
                groups.setdefault(s, []).append(k)
        return [groups[s] for s in sorted(groups)]

    def iter_keys(
        self, split: str | None = None, rank: int = 0, world_size: int = 1,
        seed: int | None = None, epoch: int = 0, buffer_size: int = 1024,
    ) -> list[str]:
        """This rank's keys for one epoch (see store.partition): disjoint across ranks, nothing lost."""
        return epoch_order(self.shard_groups(split), rank, world_size, seed, epoch, buffer_size)

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # tensors still view it; the map closes when they are gone
                pass
        self._maps.clear()
