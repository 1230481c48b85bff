"""A table version's manifest as a reader sees it: checked bytes (memory-mapped), columns parsed one at a time on
first use and kept as Arrow arrays, lookups by key and by row, each sample's location and checksum.

Part of the reader (store/reader.py), with the shard I/O (store/shard_io.py) and the sample check
(store/sample_check.py); it does no file I/O after opening. Reading and checking the files: store/manifest_files.py;
the column helpers: store/arrow_columns.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas.errors import UserError
from schemas.img_shapes import ImgShape, img_shapes_from_v1
from schemas.table import SCHEMA_V1, TableSchema
from store import format as fmt
from store import integrity
from store.arrow_columns import NARROWER, fixed_width_view, narrowed, release_memory, strictly_increasing
from store.integrity import DamagedData
from store.manifest import CHECKSUM_COLUMNS, LOCATING_COLUMNS, RESERVED_COLUMNS
from store.manifest_files import mapped_checked, read_manifest, read_schema, unreadable

log = logging.getLogger("store")

V1_PIXEL_COLUMNS = ("height", "width")


class ManifestView:
    """The parsed side of one version: schema, manifest columns, key lookups, sample locations. Built by
    `open` (a complete version on disk, its schema and manifest checked) or `over` (a manifest given as a table,
    e.g. the one `store repair` rebuilt from the shard indexes)."""

    def __init__(self, vdir: Path, table: str, version: int, schema: TableSchema, names: list[str],
                 sums: dict[str, dict[str, Any]] | None, manifest_bytes: pa.Buffer | None = None,
                 full: pa.Table | None = None) -> None:
        self.dir, self.table, self.version, self.schema, self.sums = vdir, table, version, schema, sums
        self.checksummed = sums is not None  # format 1: samples checked against sample_sha256 (slower)
        self.names = list(names)
        self._bytes, self._full = manifest_bytes, full
        self._arrays: dict[str, pa.Array] = {}
        self._cols: dict[str, list[Any]] = {}
        self.key_array: pa.StringArray = self.column("key")
        self.keys_sorted = strictly_increasing(self.key_array)
        self._key_list: list[str] | None = None
        self._row_of: dict[str, int] | None = None
        self._sorted_fixed: np.ndarray | None | bool = False  # False: not looked at yet
        self._shard_idx: np.ndarray | None = None  # row -> shard number (dictionary index), numpy
        self._shard_names: list[str] = []
        self._crc_u32: np.ndarray | None | bool = False  # sample_crc32c as numbers (False: not looked at yet)
        self.is_v1 = schema.schema_version == SCHEMA_V1

    @classmethod
    def open(cls, vdir: Path, table: str, version: int) -> "ManifestView":
        """schema.json and manifest.parquet checked against checksums.json before they are parsed. The manifest
        stays memory-mapped (checked once over the map), and columns are parsed from the map one at a time, never
        from a re-read. The map's pages are the page cache's: shared by every rank reading the version and
        dropped by the kernel when memory runs short, where a private copy (hundreds of MB at 1M samples) would
        be held by each process. Versions are immutable (replaced by rename, never rewritten)."""
        if not fmt.is_complete(vdir):
            raise UserError(f"table '{table}' v{version} at {vdir} is incomplete (no {fmt.MANIFEST}); "
                            "rerun the stage that writes it to resume")
        try:
            sums = integrity.read_version_checksums(vdir)
            schema_bytes = integrity.read_checked(vdir, fmt.SCHEMA_JSON, sums)
            manifest_bytes = mapped_checked(vdir, fmt.MANIFEST, sums)
        except DamagedData as e:  # recorded: the stage that wrote the version must not call it up to date
            integrity.record_damage(vdir, problems=[str(e)])
            raise
        schema = read_schema(vdir, schema_bytes)
        path = vdir / fmt.MANIFEST
        try:
            names = pq.ParquetFile(pa.BufferReader(manifest_bytes)).schema_arrow.names
        except Exception as e:  # noqa: BLE001
            raise unreadable(vdir, e) from None
        missing = sorted(LOCATING_COLUMNS - set(names))
        if missing:
            raise UserError(f"{path}: missing columns {missing} (see docs/store-format.md)")
        if sums is None and CHECKSUM_COLUMNS & set(names):
            raise DamagedData(f"{integrity.where(vdir)}: {fmt.CHECKSUMS} is missing; "
                              f"{integrity.repair_hint(vdir, fmt.CHECKSUMS)}")
        view = cls(vdir, table, version, schema, names, sums, manifest_bytes=manifest_bytes)
        if not view.keys_sorted and pc.count_distinct(view.key_array).as_py() != len(view.key_array):
            raise UserError(f"{path}: duplicate keys; run `pipeline store verify` on the store")
        if view.is_v1:
            lacking = [c for c in V1_PIXEL_COLUMNS if c not in names]
            if lacking:
                raise UserError(f"{path}: schema v1 table lacks pixel columns {lacking}")
            log.warning("table '%s' v%d uses schema v1: img_shapes derived from pixel sizes; "
                        "run `pipeline migrate v1-to-v2 STORE` to upgrade", table, version)
        return view

    @classmethod
    def over(cls, vdir: Path, table: str, version: int, manifest: pa.Table) -> "ManifestView":
        """A view of a given manifest table; schema.json is read as it is."""
        return cls(vdir, table, version, read_schema(vdir), manifest.column_names,
                   integrity.read_version_checksums(vdir), full=manifest)

    def version_id(self) -> str:
        """`Store.version_id` of the manifest this view checked and reads (its mapped bytes, not a second read of
        the file: a version deleted and rebuilt since the open would name another content)."""
        if self._bytes is None:  # a view `over` a given manifest (store repair): the file's
            return fmt.version_id(self.version, (self.dir / fmt.MANIFEST).read_bytes())
        with memoryview(self._bytes) as mv:
            return fmt.version_id(self.version, mv)

    # ------------------------------------------------------------ columns

    @property
    def manifest(self) -> pa.Table:
        """The whole manifest (every column, e.g. the checksum columns for verify), parsed on first use."""
        if self._full is None:
            self._full = read_manifest(self.dir, self._bytes)
        return self._full

    def column(self, name: str) -> pa.Array:
        """One manifest column as a single Arrow array, parsed from the checked manifest bytes on first use."""
        if name not in self._arrays:
            if self._full is not None:
                col = self._full.column(name)
            else:
                if name not in self.names:
                    raise KeyError(name)
                col = read_manifest(self.dir, self._bytes, columns=[name],
                                    read_dictionary=["shard"] if name == "shard" else None).column(name)
            col = col.combine_chunks()
            if self._full is None and name in NARROWER:
                col = narrowed(col, NARROWER[name])
            self._arrays[name] = col
            del col
            # the parse's scratch memory goes back to the system (the allocator keeps it otherwise: ~180 MB
            # at 1M samples, in every rank)
            release_memory()
        return self._arrays[name]

    def forget(self, name: str) -> None:
        """Drop a parsed column that only opening or joining needed (e.g. `split`, `shard_nbytes`: ~8 MB each
        at 1M samples, private to every rank); a later `column(name)` parses it again."""
        if self._full is None and name != "key":
            self._arrays.pop(name, None)
            self._cols.pop(name, None)

    def adopt_keys(self, other: "ManifestView") -> None:
        """Use another version's parsed key column, equal to this one's (the caller compared them): a joined
        `text` and `vae` hold the same keys, ~36 MB at 1M samples kept once instead of twice per rank."""
        self.key_array = self._arrays["key"] = other.key_array
        self._sorted_fixed, self._key_list, self._row_of = False, None, None

    @property
    def parsed(self) -> set[str]:
        """The columns parsed so far (kept as Arrow arrays: private memory of this process)."""
        return set(self._arrays)

    @property
    def as_python(self) -> set[str]:
        """The columns kept as whole lists of Python objects (`values`, `key_list`: for whole-table walks only)."""
        return set(self._cols) | ({"key"} if self._key_list is not None else set())

    def has_column(self, name: str) -> bool:
        return name in self.names

    def values(self, name: str) -> list[Any]:
        """A whole column as Python objects (kept): for whole-table walks, never for a single sample."""
        if name not in self._cols:
            self._cols[name] = self.column(name).to_pylist()
        return self._cols[name]

    def cell(self, name: str, i: int) -> Any:
        """One value, without turning the whole column into Python objects."""
        if name in self._cols:
            return self._cols[name][i]
        return self.column(name)[i].as_py()

    def meta_columns(self) -> list[str]:
        return [c for c in self.names if c not in RESERVED_COLUMNS]

    # ------------------------------------------------------------ keys

    def __len__(self) -> int:
        return len(self.key_array)

    def key_list(self) -> list[str]:
        if self._key_list is None:
            self._key_list = self.key_array.to_pylist()
        return self._key_list

    def row_of(self, key: str) -> int | None:
        """The key's row number, or None. Sorted fixed-width keys (content hashes: the usual case) are found by
        binary search on a zero-copy view of the key column; a million-entry key -> row dict (~1 s, ~170 MB at
        1M samples) is built only for other keys."""
        if self._sorted_fixed is False:
            self._sorted_fixed = fixed_width_view(self.key_array) if self.keys_sorted else None
        keys = self._sorted_fixed
        if keys is None:
            if self._row_of is None:
                self._row_of = {k: i for i, k in enumerate(self.key_list())}
            return self._row_of.get(key)
        b = key.encode()
        if len(b) != keys.dtype.itemsize or b"\0" in b:  # numpy `S` values drop trailing NULs
            return None
        i = int(np.searchsorted(keys, b))
        return i if i < len(keys) and keys[i] == b else None

    @property
    def key_dict_built(self) -> bool:
        """Whether lookups by key needed the key -> row dict (tests: the usual keys never do)."""
        return self._row_of is not None

    def index(self, key: str) -> int:
        i = self.row_of(key)
        if i is None:
            raise UserError(f"key {key} not in table '{self.table}' v{self.version}")
        return i

    # ------------------------------------------------------------ samples

    def shard_numbers(self) -> tuple[np.ndarray, list[str]]:
        """(each row's shard number, the shard names by number): the dictionary-encoded column's indices (numpy,
        no per-row str). A name may have more than one number (dictionaries of several row groups)."""
        if self._shard_idx is None:
            col = self.column("shard")
            if not pa.types.is_dictionary(col.type):
                col = col.dictionary_encode()
            self._shard_idx = col.indices.to_numpy(zero_copy_only=False)
            self._shard_names = col.dictionary.to_pylist()
        return self._shard_idx, self._shard_names

    def shard_of(self, i: int) -> str:
        """Sample i's shard file name."""
        idx, names = self.shard_numbers()
        return names[idx[i]]

    def rows_in(self, shards: Iterable[str]) -> np.ndarray:
        """The rows whose samples lie in these shards, in row order."""
        if not len(self):
            return np.zeros(0, np.int64)
        self.shard_of(0)  # the dictionary indices, built once
        wanted = set(shards)
        numbers = [j for j, name in enumerate(self._shard_names) if name in wanted]
        return np.flatnonzero(np.isin(self._shard_idx, numbers))

    def locate(self, i: int) -> tuple[str, int, int]:
        """(shard, offset, nbytes) of sample i's bytes; the numeric columns are read as numpy views of Arrow."""
        offs = self.column("sample_offset").to_numpy()
        sizes = self.column("sample_nbytes").to_numpy()
        return self.shard_of(i), int(offs[i]), int(sizes[i])

    def sample_crcs(self) -> np.ndarray | None:
        """The `sample_crc32c` column as uint32 numbers (4 bytes a row, not a 12-byte string: ~8 MB less at 1M
        samples) when every value is 8 lowercase hex digits, as the writer writes them; else None (the strings
        are read as they are)."""
        if self._crc_u32 is False:
            self._crc_u32 = None
            col = self.column("sample_crc32c")
            raw = fixed_width_view(col)
            if raw is not None and raw.dtype.itemsize == 8:
                digits = raw.view(np.uint8)
                if np.all(((digits >= 48) & (digits <= 57)) | ((digits >= 97) & (digits <= 102))):  # 0-9 a-f
                    self._crc_u32 = np.frombuffer(bytes.fromhex(digits.tobytes().decode()), dtype=">u4").astype(
                        np.uint32)
                    self._arrays.pop("sample_crc32c")  # the strings go: the numbers say the same
                    release_memory()
        return self._crc_u32

    def checksum_row(self, i: int) -> dict[str, Any]:
        if "sample_crc32c" in self.names:  # format 2: the sha256 column (64 MB at 1M samples) is never parsed
            crcs = self.sample_crcs()
            crc = f"{int(crcs[i]):08x}" if crcs is not None else self.cell("sample_crc32c", i)
            if crc:
                return {"sample_crc32c": crc}
        return {"sample_sha256": self.cell("sample_sha256", i), "sample_crc32c": None}

    def prepare_checks(self) -> None:
        """Parse the columns a sample check reads (before another thread checks: it then only reads them)."""
        names = ["shard", "sample_offset", "sample_nbytes"]
        if "sample_crc32c" not in self.names:
            names.append("sample_sha256")
        for name in names:
            if name in self.names:
                self.column(name)
        if "sample_crc32c" in self.names and self.sample_crcs() is None:
            self.column("sample_crc32c")
        self.shard_of(0) if len(self) else None

    def meta_at(self, i: int) -> dict[str, Any]:
        """Sample i's meta columns, cell by cell: `values` would turn every meta column of the table into Python
        objects, kept (~1.8 GB at 1M samples in every encode rank, which asks one sample at a time)."""
        out = {c: self.cell(c, i) for c in self.meta_columns()}
        if self.is_v1:
            out["img_shapes"] = [list(s) for s in self.img_shapes_at(i)]
        return out

    def img_shapes_at(self, i: int) -> list[ImgShape]:
        if self.is_v1:
            row = {c: self.cell(c, i) for c in ("height", "width", "control_height", "control_width")
                   if c in self.names}
            return img_shapes_from_v1(row)
        return [tuple(s) for s in self.cell("img_shapes", i)]  # type: ignore[misc]
