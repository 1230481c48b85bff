"""Reading one table version: mmap fast path (tensors sliced by manifest offsets, no tar parsing, no copy),
random access by key, meta, img_shapes (derived on the fly for schema v1), rank/epoch iteration order.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path
from typing import Any

import pyarrow as pa
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


class TableReader:
    def __init__(self, vdir: Path, table: str, version: int) -> None:
        self.dir, self.table, self.version = vdir, table, version
        if not fmt.is_complete(vdir):
            raise UserError(f"table '{table}' v{version} at {vdir} is incomplete (no {fmt.MANIFEST}); "
                            "rerun the stage that writes it to resume")
        self.schema = read_schema(vdir)
        self.manifest: pa.Table = pq.read_table(vdir / fmt.MANIFEST)
        missing = sorted(LOCATING_COLUMNS - set(self.manifest.column_names))
        if missing:
            raise UserError(f"{vdir / fmt.MANIFEST}: missing columns {missing} (see docs/store-format.md)")
        self._keys: list[str] = self.manifest.column("key").to_pylist()
        self._row = {k: i for i, k in enumerate(self._keys)}
        if len(self._row) != len(self._keys):
            raise UserError(f"{vdir / fmt.MANIFEST}: duplicate keys; run `pipeline store verify` on the store")
        self._cols: dict[str, list[Any]] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self.is_v1 = self.schema.schema_version == SCHEMA_V1
        if self.is_v1:
            lacking = [c for c in V1_PIXEL_COLUMNS if c not in self.manifest.column_names]
            if lacking:
                raise UserError(f"{vdir / fmt.MANIFEST}: schema v1 table lacks pixel columns {lacking}")
            log.warning("table '%s' v%d uses schema v1: img_shapes derived from pixel sizes; "
                        "run `pipeline migrate v1-to-v2 STORE` to upgrade", table, version)

    # ------------------------------------------------------------ basics

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._row

    def keys(self) -> list[str]:
        return list(self._keys)

    def _col(self, name: str) -> list[Any]:
        if name not in self._cols:
            self._cols[name] = self.manifest.column(name).to_pylist()
        return self._cols[name]

    def _index(self, key: str) -> int:
        try:
            return self._row[key]
        except KeyError:
            raise UserError(f"key {key} not in table '{self.table}' v{self.version}") from None

    def meta_columns(self) -> list[str]:
        return [c for c in self.manifest.column_names if c not in LOCATING_COLUMNS]

    def meta(self, key: str) -> dict[str, Any]:
        i = self._index(key)
        out = {c: self._col(c)[i] for c in self.meta_columns()}
        if self.is_v1:
            out["img_shapes"] = [list(s) for s in self.img_shapes(key)]
        return out

    def img_shapes(self, key: str) -> list[ImgShape]:
        i = self._index(key)
        if self.is_v1:
            row = {c: self._col(c)[i] for c in ("height", "width", "control_height", "control_width")
                   if c in self.manifest.column_names}
            return img_shapes_from_v1(row)
        return [tuple(s) for s in self._col("img_shapes")[i]]  # type: ignore[misc]

    # ------------------------------------------------------------ bytes

    def shard_map(self, shard: str) -> mmap.mmap:
        """Private (copy-on-write) map: tensors are writable views, and a write never reaches the file."""
        m = self._maps.get(shard)
        if m is None:
            with open(self.dir / shard, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[shard] = m
        return m

    def tensors(self, key: str) -> dict[str, torch.Tensor]:
        i = self._index(key)
        m = self.shard_map(self._col("shard")[i])
        out = {}
        for t in self._col("tensors")[i]:
            dt = torch_dtype(t["dtype"])
            n = t["nbytes"] // dt.itemsize
            if n == 0:  # frombuffer rejects count=0; an empty tensor (e.g. no control views) is legal
                out[t["name"]] = torch.empty(t["shape"], dtype=dt)
                continue
            out[t["name"]] = torch.frombuffer(m, dtype=dt, count=n, offset=t["offset"]).view(t["shape"])
        return out

    def files(self, key: str) -> dict[str, bytes]:
        i = self._index(key)
        m = self.shard_map(self._col("shard")[i])
        return {f["name"]: m[f["offset"] : f["offset"] + f["nbytes"]] for f in self._col("files")[i]}

    def get(self, key: str) -> dict[str, Any]:
        return {"key": key, "meta": self.meta(key), "tensors": self.tensors(key), "files": self.files(key)}

    def shard_paths(self) -> list[Path]:
        return [self.dir / s for s in dict.fromkeys(self._col("shard"))]

    # ------------------------------------------------------------ iteration

    def shard_groups(self, split: str | None = None) -> list[list[str]]:
        """Keys grouped by shard (in shard order, then key order), optionally only one split."""
        splits = self._col("split") if split is not None and "split" in self.manifest.column_names else None
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
