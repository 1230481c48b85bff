"""Reading one table version: tensors sliced by manifest offsets (no tar parsing) - from a shard map when the
reader scans a shard (no copy), else from one pread of the sample's bytes into a buffer of its own -, random
access by key, meta, img_shapes (derived on the fly for schema v1), rank/epoch iteration order.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from schemas.errors import UserError
from schemas.img_shapes import ImgShape, img_shapes_from_v1
from schemas.table import KNOWN_SCHEMA_VERSIONS, SCHEMA_V1, TableSchema
from store import format as fmt
from store import integrity
from store.check_ahead import DEFAULT_WINDOW, CheckAhead
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


def _unreadable(vdir: Path, e: Exception) -> DamagedData:
    return DamagedData(f"{vdir / fmt.MANIFEST} is unreadable ({type(e).__name__}: {e}); "
                       f"{integrity.repair_hint(vdir)}")


def read_manifest(vdir: Path, data: bytes | pa.Buffer, columns: list[str] | None = None,
                  read_dictionary: list[str] | None = None) -> pa.Table:
    """Parse (some columns of) checked manifest bytes; undecodable parquet is one clear error, not a traceback."""
    try:
        return pq.read_table(pa.BufferReader(data), columns=columns, read_dictionary=read_dictionary)
    except Exception as e:  # noqa: BLE001
        raise _unreadable(vdir, e) from None


DEFAULT_MAX_OPEN_SHARDS = 256  # shard files kept open per reader (LRU); the kernel allows ~65k maps a process
SCAN_RUN = 3  # this many reads in a row from one shard make it a scan: the shard is mapped (random reads pread)


def fixed_width_view(arr: pa.Array) -> np.ndarray | None:
    """A string array whose values all have one byte length, as a zero-copy numpy `S<width>` view (None when
    they do not, or when there are nulls). Bytewise order = Arrow's string order."""
    if len(arr) == 0 or arr.null_count or not pa.types.is_string(arr.type):
        return None
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
    width = int(offsets[1] - offsets[0])
    if width == 0 or not np.all(np.diff(offsets) == width):
        return None
    return np.frombuffer(arr.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]].view(f"S{width}")


def _mapped_checked(vdir: Path, name: str, sums: dict[str, dict[str, Any]] | None) -> pa.Buffer:
    """A file of the version memory-mapped read-only, checked against checksums.json when the version has one."""
    try:
        mapped = pa.memory_map(os.path.join(str(vdir), name))
    except FileNotFoundError:
        raise DamagedData(f"{integrity.where(vdir)}: {name} is missing; {integrity.repair_hint(vdir, name)}") from None
    data = mapped.read_buffer()  # holds the map open for as long as the buffer (or a column sliced from it) lives
    if sums is not None:
        with memoryview(data) as mv:
            integrity.check_bytes(vdir, name, mv, sums)
    return data


def _strictly_increasing(keys: pa.Array) -> bool:
    """Manifests are sorted by key: strictly increasing keys are unique (a vectorised check, no hash set)."""
    if len(keys) < 2:
        return True
    return bool(pc.all(pc.less(keys.slice(0, len(keys) - 1), keys.slice(1))).as_py())


class TableReader:
    """on_damaged="stop": a damaged sample, or a missing / short shard, raises `DamagedData` (on open for the
    shards, on the sample's first read for its bytes). "skip": open succeeds; `damaged(key)` tells which samples
    cannot be read, and reading one still raises."""

    def __init__(self, vdir: Path, table: str, version: int, max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS,
                 on_damaged: str = "stop") -> None:
        self.dir, self.table, self.version = vdir, table, version
        self._dir_str = str(vdir)
        if not fmt.is_complete(vdir):
            raise UserError(f"table '{table}' v{version} at {vdir} is incomplete (no {fmt.MANIFEST}); "
                            "rerun the stage that writes it to resume")
        # schema.json and manifest.parquet are checked against checksums.json before they are parsed; the
        # manifest stays memory-mapped (checked once over the map), and columns are parsed from the map one at a
        # time, never from a re-read. The map's pages are the page cache's: shared by every rank reading the
        # version and dropped by the kernel when memory runs short, where a private copy (hundreds of MB at 1M
        # samples) would be held by each process. Versions are immutable (replaced by rename, never rewritten).
        try:
            sums = integrity.read_version_checksums(vdir)
            schema_bytes = integrity.read_checked(vdir, fmt.SCHEMA_JSON, sums)
            self._manifest_bytes = _mapped_checked(vdir, fmt.MANIFEST, sums)
        except DamagedData as e:  # recorded: the stage that wrote the version must not call it up to date
            integrity.record_damage(vdir, problems=[str(e)])
            raise
        self.schema = read_schema(vdir, schema_bytes)
        path = vdir / fmt.MANIFEST
        try:
            names = pq.ParquetFile(pa.BufferReader(self._manifest_bytes)).schema_arrow.names
        except Exception as e:  # noqa: BLE001
            raise _unreadable(vdir, e) from None
        missing = sorted(LOCATING_COLUMNS - set(names))
        if missing:
            raise UserError(f"{path}: missing columns {missing} (see docs/store-format.md)")
        if sums is None and CHECKSUM_COLUMNS & set(names):
            raise DamagedData(f"{integrity.where(vdir)}: {fmt.CHECKSUMS} is missing; "
                              f"{integrity.repair_hint(vdir, fmt.CHECKSUMS)}")
        self.checksummed = sums is not None  # format 1: samples checked against sample_sha256 (slower)
        self._names = list(names)
        self._full: pa.Table | None = None
        self._arrays: dict[str, pa.Array] = {}
        # Opening reads the key column only (plus shard sizes for the presence check); every other column is
        # read on first use, alone (`column`), and kept as an Arrow array: a million-sample table never becomes
        # a million Python dicts.
        self.key_array: pa.StringArray = self.column("key")
        self.keys_sorted = _strictly_increasing(self.key_array)
        if not self.keys_sorted and pc.count_distinct(self.key_array).as_py() != len(self.key_array):
            raise UserError(f"{path}: duplicate keys; run `pipeline store verify` on the store")
        self._key_list: list[str] | None = None
        self._row_of: dict[str, int] | None = None
        self._sorted_fixed: np.ndarray | None | bool = False  # False: not looked at yet
        self._cols: dict[str, list[Any]] = {}
        self._open: OrderedDict[str, int | mmap.mmap] = OrderedDict()  # shard -> descriptor, or map when scanned
        self._run: tuple[str | None, int] = (None, 0)  # (shard of the last reads, how many in a row)
        self.max_open_shards = max(1, int(max_open_shards))
        self.bad_shards = integrity.shard_problems(
            vdir, pa.table({"shard": self.column("shard"), "shard_nbytes": self.column("shard_nbytes")}), sums)
        self.records_damage = True  # damage found is recorded in the store (integrity.record_damage)
        if self.bad_shards:
            integrity.record_damage(vdir, shards=self.bad_shards)
        if self.bad_shards and on_damaged == "stop":
            raise DamagedData(f"{integrity.where(vdir)}: {next(iter(self.bad_shards.values()))}"
                              + (f" (and {len(self.bad_shards) - 1} more shards)" if len(self.bad_shards) > 1 else "")
                              + f"; {integrity.repair_hint(vdir)}")
        self._checked: set[int] = set()
        self._ahead: CheckAhead | None = None
        self.is_v1 = self.schema.schema_version == SCHEMA_V1
        if self.is_v1:
            lacking = [c for c in V1_PIXEL_COLUMNS if c not in names]
            if lacking:
                raise UserError(f"{path}: schema v1 table lacks pixel columns {lacking}")
            log.warning("table '%s' v%d uses schema v1: img_shapes derived from pixel sizes; "
                        "run `pipeline migrate v1-to-v2 STORE` to upgrade", table, version)

    @classmethod
    def over_manifest(cls, vdir: Path, table: str, version: int, manifest: pa.Table) -> "TableReader":
        """A reader that skips damage (on_damaged="skip") over a given manifest table, e.g. one `store repair`
        rebuilt from the shard indexes; schema.json is read as it is."""
        r = cls.__new__(cls)
        r.dir, r.table, r.version = vdir, table, version
        r._dir_str = str(vdir)
        r.schema = read_schema(vdir)
        sums = integrity.read_version_checksums(vdir)
        r.checksummed = sums is not None
        r._manifest_bytes = None
        r._names = list(manifest.column_names)
        r._full = manifest
        r._arrays = {}
        r.key_array = r.column("key")
        r.keys_sorted = _strictly_increasing(r.key_array)
        r._key_list, r._row_of, r._cols, r._sorted_fixed = None, None, {}, False
        r._open, r._run = OrderedDict(), (None, 0)
        r.max_open_shards = DEFAULT_MAX_OPEN_SHARDS
        r.bad_shards = integrity.shard_problems(vdir, manifest, sums)
        r._checked = set()
        r._ahead = None
        r.records_damage = False  # store repair's scan: it writes its own record
        r.is_v1 = r.schema.schema_version == SCHEMA_V1
        return r

    # ------------------------------------------------------------ basics

    @property
    def manifest(self) -> pa.Table:
        """The whole manifest (every column, e.g. the checksum columns for verify), parsed on first use."""
        if self._full is None:
            self._full = read_manifest(self.dir, self._manifest_bytes)
        return self._full

    def column(self, name: str) -> pa.Array:
        """One manifest column as a single Arrow array, parsed from the checked manifest bytes on first use."""
        if name not in self._arrays:
            if self._full is not None:
                col = self._full.column(name)
            else:
                if name not in self._names:
                    raise KeyError(name)
                col = read_manifest(self.dir, self._manifest_bytes, columns=[name],
                                    read_dictionary=["shard"] if name == "shard" else None).column(name)
            self._arrays[name] = col.combine_chunks()
            del col
            # the parse's scratch memory goes back to the system (the allocator keeps it otherwise: ~180 MB
            # at 1M samples, in every rank)
            pa.default_memory_pool().release_unused()
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
        return self.row_of(key) is not None

    def row_of(self, key: str) -> int | None:
        """The key's row number, or None. Sorted fixed-width keys (content hashes: the usual case) are found by
        binary search on a zero-copy view of the key column; a million-entry key -> row dict (~1 s, ~170 MB at
        1M samples) is built only for other keys."""
        if self._sorted_fixed is False:
            self._sorted_fixed = fixed_width_view(self.key_array) if self.keys_sorted else None
        keys = self._sorted_fixed
        if keys is None:
            return self._row.get(key)
        b = key.encode()
        if len(b) != keys.dtype.itemsize or b"\0" in b:  # numpy `S` values drop trailing NULs
            return None
        i = int(np.searchsorted(keys, b))
        return i if i < len(keys) and keys[i] == b else None

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
        i = self.row_of(key)
        if i is None:
            raise UserError(f"key {key} not in table '{self.table}' v{self.version}")
        return i

    def meta_columns(self) -> list[str]:
        return [c for c in self._names if c not in RESERVED_COLUMNS]

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

        A shard found missing or of the wrong size on open raises `DamagedData` naming the repair command."""
        if shard in self.bad_shards:
            raise DamagedData(f"{integrity.where(self.dir)}: {self.bad_shards[shard]}; "
                              f"{integrity.repair_hint(self.dir)}")
        return self._map(shard)

    def _handle(self, shard: str) -> int | mmap.mmap:
        """The shard's open descriptor or map. At most `max_open_shards` stay open here (least recently used
        closed first): a million-sample store has tens of thousands of shards. A dropped map whose tensors are
        still alive closes when they go."""
        h = self._open.get(shard)
        if h is not None:
            self._open.move_to_end(shard)
            return h
        h = os.open(os.path.join(self._dir_str, shard), os.O_RDONLY)  # os.path: pathlib costs more than the read
        self._open[shard] = h
        while len(self._open) > self.max_open_shards:
            _, old = self._open.popitem(last=False)
            _close(old)
        return h

    def prepare_checks(self) -> None:
        """Parse the columns a sample check reads (before another thread checks: it then only reads them)."""
        names = ["shard", "sample_offset", "sample_nbytes", "sample_crc32c"]
        if "sample_crc32c" not in self._names:
            names.append("sample_sha256")
        for name in names:
            if name in self._names:
                self.column(name)

    def _problem(self, i: int, mapper) -> str | None:
        """What is wrong with sample i's bytes (None: they match their checksum), read through `mapper` (shard ->
        map): the check-ahead thread's own maps (the reader's LRU is not thread-safe)."""
        shard = self._cell("shard", i)
        start, n = self._cell("sample_offset", i), self._cell("sample_nbytes", i)
        if shard in self.bad_shards:
            problem = self._shard_problem(shard, start, n)
            if problem is not None:
                return problem
        m = mapper(shard)
        if len(m) < start + n:
            return f"the shard ends {start + n - len(m)} bytes before the sample does"
        with memoryview(m) as mv:
            part = mv[start : start + n]
            try:
                return integrity.sample_problem(part, self._checksum_row(i))
            finally:
                part.release()

    def _map(self, shard: str) -> mmap.mmap:
        h = self._handle(shard)
        if isinstance(h, int):
            try:
                m = mmap.mmap(h, 0, access=mmap.ACCESS_COPY)  # the map keeps its own duplicate of the descriptor
            finally:
                os.close(h)
                del self._open[shard]
            self._open[shard] = h = m
        return h

    def _sample_buffer(self, shard: str, start: int, n: int) -> tuple[Any, int] | str:
        """(buffer, where shard offset 0 lies in it), or what is wrong. The `SCAN_RUN`-th and later reads in a row
        from one shard (a scan) come from the shard's map (zero-copy views, the kernel's readahead); any other
        read is one pread of the sample's bytes into a fresh buffer that only this sample's tensors reference
        (never reused). A random read in a million-sample store hits one shard of ~20k, so a map would be set up
        and torn down for a single sample, and one large read is what a cold disk serves best."""
        last, count = self._run
        self._run = (shard, count + 1 if shard == last else 1)
        if self._run[1] >= SCAN_RUN:
            return self._map(shard), 0
        h = self._handle(shard)
        buf = np.empty(n, np.uint8)
        if isinstance(h, int):
            got = os.preadv(h, [buf], start)
        else:  # mapped by an earlier scan (the map keeps no descriptor we can use): read like any random read
            fd = os.open(os.path.join(self._dir_str, shard), os.O_RDONLY)
            try:
                got = os.preadv(fd, [buf], start)
            finally:
                os.close(fd)
        if got != n:
            return f"the shard ends {n - got} bytes before the sample does"
        return buf, -start

    def _checked_bytes(self, i: int) -> tuple[Any, int]:
        """Sample i's bytes as (buffer, where shard offset 0 lies in it), checked against their checksum on the
        reader's first read of the sample (the store is immutable, and the private map never sees a consumer's
        writes to a tensor view). Raises `DamagedData` naming the sample and the repair command."""
        shard = self._cell("shard", i)
        start, n = self._cell("sample_offset", i), self._cell("sample_nbytes", i)
        problem = self._shard_problem(shard, start, n) if shard in self.bad_shards else None
        if problem is None and i not in self._checked and self._ahead is not None:
            # The check-ahead thread verified these bytes of the (immutable) shard through its own map.
            done, problem = self._ahead.take(i)
            if done and problem is None:
                self._checked.add(i)
        if problem is None:  # a bad shard's intact samples are still checked byte by byte
            got = self._sample_buffer(shard, start, n)
            if isinstance(got, str):
                problem = got
            elif i not in self._checked:
                with memoryview(got[0]) as mv:
                    part = mv[start + got[1] : start + got[1] + n]
                    try:
                        problem = integrity.sample_problem(part, self._checksum_row(i))
                    finally:
                        part.release()
        if problem is not None:
            key = self.key_array[i].as_py()
            if self.records_damage:  # the stage that wrote the version must not call it up to date
                integrity.record_damage(self.dir, {key: problem})
            raise DamagedData(integrity.damaged_sample_message(self.dir, shard, key, problem))
        self._checked.add(i)
        return got

    def _checksum_row(self, i: int) -> dict[str, Any]:
        if "sample_crc32c" in self._names:  # format 2: the sha256 column (64 MB at 1M samples) is never parsed
            crc = self._cell("sample_crc32c", i)
            if crc:
                return {"sample_crc32c": crc}
        return {"sample_sha256": self._cell("sample_sha256", i), "sample_crc32c": None}

    def _shard_problem(self, shard: str, start: int, n: int) -> str | None:
        """What the open-time check found wrong with a shard, if it makes this sample unreadable."""
        try:
            size = (self.dir / shard).stat().st_size
        except FileNotFoundError:
            return self.bad_shards[shard]
        if size < start + n:
            return f"{self.bad_shards[shard]}; the sample lies beyond its end"
        if size == 0:
            return self.bad_shards[shard]
        return None

    def _intact_bytes(self, i: int) -> tuple[Any, int]:
        """Checked bytes of a sample in a shard that is whole (a bad shard's samples are not served)."""
        got = self._checked_bytes(i)
        shard = self._cell("shard", i)
        if shard in self.bad_shards:
            raise DamagedData(f"{integrity.where(self.dir)}: {self.bad_shards[shard]}; "
                              f"{integrity.repair_hint(self.dir)}")
        return got

    def check(self, key: str) -> None:
        """Raise `DamagedData` unless the sample's bytes match their checksum (checked once per reader)."""
        self.check_at(self._index(key))

    def check_at(self, i: int) -> None:
        if i not in self._checked:
            self._checked_bytes(i)

    def check_ahead(self, order: Iterable[int], window: int = DEFAULT_WINDOW) -> CheckAhead:
        """Check the rows of `order` (the consumer's read order, may be endless) in a background thread, at most
        `window` rows ahead of the consumer (store/check_ahead.py); `check_at` then only waits for a row's result.
        Replaces a running check-ahead; `stop_check_ahead` or `close` ends it."""
        self.stop_check_ahead()
        self._ahead = CheckAhead(self, order, window)
        return self._ahead

    def stop_check_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close()

    def damaged(self, key: str) -> str | None:
        """None if the sample reads back intact, else what is wrong (does not raise)."""
        return self.damaged_at(self._index(key))

    def damaged_at(self, i: int) -> str | None:
        try:
            self.check_at(i)
        except DamagedData as e:
            return str(e)
        return None

    def tensors(self, key: str) -> dict[str, torch.Tensor]:
        return self.tensors_at(self._index(key))

    def tensors_at(self, i: int) -> dict[str, torch.Tensor]:
        """The sample's tensors: views of the shard map during a scan, else of the sample's own buffer."""
        buf, base = self._intact_bytes(i)
        out = {}
        for t in self._cell("tensors", i):
            dt = torch_dtype(t["dtype"])
            n = t["nbytes"] // dt.itemsize
            if n == 0:  # frombuffer rejects count=0; an empty tensor (e.g. no control views) is legal
                out[t["name"]] = torch.empty(t["shape"], dtype=dt)
                continue
            out[t["name"]] = torch.frombuffer(buf, dtype=dt, count=n, offset=t["offset"] + base).view(t["shape"])
        return out

    def files(self, key: str) -> dict[str, bytes]:
        i = self._index(key)
        buf, base = self._intact_bytes(i)
        with memoryview(buf) as mv:
            return {f["name"]: bytes(mv[f["offset"] + base : f["offset"] + base + f["nbytes"]])
                    for f in self._cell("files", i)}

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
        self.stop_check_ahead()
        for h in self._open.values():
            _close(h)
        self._open.clear()


def _close(h: int | mmap.mmap) -> None:
    """A descriptor is closed; a map is only dropped, never closed: tensors from torch.frombuffer hold a reference
    to the map but no buffer export, so close() would unmap memory they still view (a segfault on their next
    read). The map unmaps when the last tensor viewing it goes."""
    if isinstance(h, int):
        os.close(h)
