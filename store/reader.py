"""Reading one table version: mmap fast path (tensors sliced by manifest offsets, no tar parsing, no copy),
random access by key, meta, img_shapes (derived on the fly for schema v1), rank/epoch iteration order.
"""

from __future__ import annotations

import json
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
from store import integrity
from store.integrity import DamagedData
from store.manifest import CHECKSUM_COLUMNS, LOCATING_COLUMNS, RESERVED_COLUMNS
from store.partition import epoch_order

log = logging.getLogger("store")

V1_PIXEL_COLUMNS = ("height", "width")


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise UserError(f"unknown tensor dtype {name!r} in manifest")
    return dt


def read_schema(vdir: Path, data: bytes | None = None) -> TableSchema:
    if data is None:
        raw = fmt.read_json(vdir / fmt.SCHEMA_JSON, "schema.json")
    else:
        try:
            raw = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{vdir / fmt.SCHEMA_JSON} is not valid JSON ({e})") from None
    found = raw.get("schema_version") if isinstance(raw, dict) else None
    if found not in KNOWN_SCHEMA_VERSIONS:
        raise UserError(f"{vdir / fmt.SCHEMA_JSON}: expected schema version one of {KNOWN_SCHEMA_VERSIONS}, "
                        f"found {found!r}; use a pipeline release that reads it")
    try:
        return TableSchema.from_dict(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{vdir / fmt.SCHEMA_JSON}: not a valid table schema ({type(e).__name__}: {e})") from None


def read_manifest(vdir: Path, data: bytes) -> pa.Table:
    try:
        return pq.read_table(pa.BufferReader(data))
    except Exception as e:  # noqa: BLE001 - any undecodable parquet is one clear error, not a traceback
        raise DamagedData(f"{vdir / fmt.MANIFEST} is unreadable ({type(e).__name__}: {e}); "
                          f"{integrity.repair_hint(vdir)}") from None


class TableReader:
    """on_damaged="stop": a damaged sample, or a missing / short shard, raises `DamagedData` (on open for the
    shards, on the sample's first read for its bytes). "skip": open succeeds; `damaged(key)` tells which samples
    cannot be read, and reading one still raises."""

    def __init__(self, vdir: Path, table: str, version: int, on_damaged: str = "stop") -> None:
        self.dir, self.table, self.version = vdir, table, version
        if not fmt.is_complete(vdir):
            raise UserError(f"table '{table}' v{version} at {vdir} is incomplete (no {fmt.MANIFEST}); "
                            "rerun the stage that writes it to resume")
        # schema.json and manifest.parquet are checked against checksums.json before they are parsed
        sums = integrity.read_version_checksums(vdir)
        self.schema = read_schema(vdir, integrity.read_checked(vdir, fmt.SCHEMA_JSON, sums))
        self.manifest: pa.Table = read_manifest(vdir, integrity.read_checked(vdir, fmt.MANIFEST, sums))
        missing = sorted(LOCATING_COLUMNS - set(self.manifest.column_names))
        if missing:
            raise UserError(f"{vdir / fmt.MANIFEST}: missing columns {missing} (see docs/store-format.md)")
        if sums is None and CHECKSUM_COLUMNS & set(self.manifest.column_names):
            raise DamagedData(f"{integrity.where(vdir)}: {fmt.CHECKSUMS} is missing; {integrity.repair_hint(vdir)}")
        self.checksummed = sums is not None  # format 1: samples checked against sample_sha256 (slower)
        self.bad_shards = integrity.shard_problems(vdir, self.manifest, sums)
        if self.bad_shards and on_damaged == "stop":
            raise DamagedData(f"{integrity.where(vdir)}: {next(iter(self.bad_shards.values()))}"
                              + (f" (and {len(self.bad_shards) - 1} more shards)" if len(self.bad_shards) > 1 else "")
                              + f"; {integrity.repair_hint(vdir)}")
        self._checked: set[int] = set()
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
        return [c for c in self.manifest.column_names if c not in RESERVED_COLUMNS]

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
            if shard in self.bad_shards:
                raise DamagedData(f"{integrity.where(self.dir)}: {self.bad_shards[shard]}; "
                                  f"{integrity.repair_hint(self.dir)}")
            with open(self.dir / shard, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[shard] = m
        return m

    def _problem(self, i: int) -> str | None:
        """What is wrong with sample i's bytes (None: they match their checksum)."""
        shard = self._col("shard")[i]
        start, n = self._col("sample_offset")[i], self._col("sample_nbytes")[i]
        size = None
        if shard in self.bad_shards:
            try:
                size = (self.dir / shard).stat().st_size
            except FileNotFoundError:
                return self.bad_shards[shard]
            if size < start + n:
                return f"{self.bad_shards[shard]}; the sample lies beyond its end"
            if size == 0:
                return self.bad_shards[shard]
        m = self.shard_map(shard) if shard not in self.bad_shards else self._map_anyway(shard)
        row = {"sample_sha256": self._col("sample_sha256")[i],
               "sample_crc32c": self._col("sample_crc32c")[i] if "sample_crc32c" in self.manifest.column_names else None}
        with memoryview(m) as mv:
            part = mv[start : start + n]
            try:
                return integrity.sample_problem(part, row)
            finally:
                part.release()

    def _map_anyway(self, shard: str) -> mmap.mmap:
        if shard not in self._maps:
            with open(self.dir / shard, "rb") as f:
                self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[shard]

    def check(self, key: str) -> None:
        """Raise `DamagedData` unless the sample's bytes match their checksum (checked once per reader: the
        store is immutable, and the private map never sees a consumer's writes to a tensor view)."""
        i = self._index(key)
        if i in self._checked:
            return
        problem = self._problem(i)
        if problem is not None:
            raise DamagedData(integrity.damaged_sample_message(self.dir, self._col("shard")[i], key, problem))
        self._checked.add(i)

    def damaged(self, key: str) -> str | None:
        """None if the sample reads back intact, else what is wrong (does not raise)."""
        try:
            self.check(key)
        except DamagedData as e:
            return str(e)
        return None

    def tensors(self, key: str) -> dict[str, torch.Tensor]:
        self.check(key)
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
        self.check(key)
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
