"""A table version's manifest as a reader sees it: checked bytes (memory-mapped), columns parsed one at a time on
first use and kept as Arrow arrays, meta and img_shapes by row. It composes the lookups by key (`keys`:
store/key_index.py, which holds the key column) and each sample's location and checksum (`samples`:
store/sample_locator.py).

Under the reader's manifest side (store/reader_manifest.py); the reader (store/reader.py) adds the shard I/O
(store/shard_io.py) and the sample check (store/sample_check.py). It does no file I/O after opening. Reading and
checking the files, and the manifest's row groups read from its bytes (`ManifestGroups`): store/manifest_files.py;
the column helpers: store/arrow_columns.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import UserError
from schemas.img_shapes import ImgShape, img_shapes_from_v1
from schemas.table import SCHEMA_V1, TableSchema
from store import format as fmt
from store import integrity
from store.arrow_columns import NARROWER, release_memory
from store.integrity import DamagedData
from store.key_index import KeyIndex
from store.manifest import CHECKSUM_COLUMNS, LOCATING_COLUMNS, RESERVED_COLUMNS
from store.manifest_files import ManifestGroups, mapped_checked, read_column, read_manifest, read_schema
from store.sample_locator import SampleLocator

log = logging.getLogger("store")

V1_PIXEL_COLUMNS = ("height", "width")
# `rows_at` decodes this many manifest rows at a time (a few MB of the meta columns of `images`)
_ROWS_PER_BATCH = 16_384


class ManifestView:
    """The parsed side of one version: schema, manifest columns, lookups by key (`keys`), sample locations and
    checksums (`samples`). Built by `open` (a complete version on disk, its schema and manifest checked) or `over`
    (a manifest given as a table, e.g. the one `store repair` rebuilt from the shard indexes)."""

    def __init__(self, vdir: Path, table: str, version: int, schema: TableSchema, names: list[str],
                 sums: dict[str, dict[str, Any]] | None, manifest_bytes: pa.Buffer | None = None,
                 full: pa.Table | None = None) -> None:
        self.dir, self.table, self.version, self.schema, self.sums = vdir, table, version, schema, sums
        self.checksummed = sums is not None  # format 1: samples checked against sample_sha256 (slower)
        self.names = list(names)
        self._bytes, self._full = manifest_bytes, full
        self._arrays: dict[str, pa.Array] = {}
        self._cols: dict[str, list[Any]] = {}
        self.keys = KeyIndex(self._parse("key"), f"table '{table}' v{version}")  # holds the key column
        self.samples = SampleLocator(self)
        self.is_v1 = schema.schema_version == SCHEMA_V1

    @classmethod
    def open(cls, vdir: Path, table: str, version: int) -> "ManifestView":
        """schema.json and manifest.parquet checked against checksums.json before they are parsed. The manifest
        stays memory-mapped (checked once over the map), and columns are parsed from the map one at a time, never
        from a re-read. The map's pages are the page cache's: shared by every rank reading the version and
        dropped by the kernel when memory runs short, where a private copy (hundreds of MB at 1M samples) would
        be held by each process. Versions are immutable (replaced by rename, never rewritten)."""
        from store.remote_shards import refetch_metadata

        # a store URL's cached copy is committed whole (renamed into place): one without a manifest lost it on the
        # node's disk, fetched again
        if not fmt.is_complete(vdir) and not (refetch_metadata(vdir) and fmt.is_complete(vdir)):
            raise UserError(f"table '{table}' v{version} at {vdir} is incomplete (no {fmt.MANIFEST}); "
                            "rerun the stage that writes it to resume")

        for attempt in (1, 2):
            try:
                sums = integrity.read_version_checksums(vdir)
                schema_bytes = integrity.read_checked(vdir, fmt.SCHEMA_JSON, sums)
                manifest_bytes = mapped_checked(vdir, fmt.MANIFEST, sums)
                break
            except DamagedData as e:
                if attempt == 1 and refetch_metadata(vdir):  # a store URL's cached copy: fetched again
                    continue
                # recorded: the stage that wrote the version must not call it up to date
                integrity.record_damage(vdir, problems=[str(e)])
                raise
        schema = read_schema(vdir, schema_bytes, intact=sums is not None)
        path = vdir / fmt.MANIFEST
        names = ManifestGroups(manifest_bytes, vdir, record=True).names
        missing = sorted(LOCATING_COLUMNS - set(names))
        if missing:
            raise UserError(f"{path}: missing columns {missing} (see docs/store-format.md)")
        if sums is None and CHECKSUM_COLUMNS & set(names):
            raise DamagedData(f"{integrity.where(vdir)}: {fmt.CHECKSUMS} is missing; "
                              f"{integrity.repair_hint(vdir, fmt.CHECKSUMS)}")
        view = cls(vdir, table, version, schema, names, sums, manifest_bytes=manifest_bytes)
        if not view.keys.sorted and pc.count_distinct(view.keys.array).as_py() != len(view):
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
            return fmt.version_id(self.version, self.dir / fmt.MANIFEST)
        with memoryview(self._bytes) as mv:
            return fmt.version_id(self.version, mv)

    # ------------------------------------------------------------ columns

    @property
    def manifest(self) -> pa.Table:
        """The whole manifest (every column, e.g. the checksum columns for verify), parsed on first use."""
        if self._full is None:
            self._full = read_manifest(self.dir, self._bytes, record=True)
        return self._full

    def column(self, name: str) -> pa.Array:
        """One manifest column as a single Arrow array, parsed from the checked manifest bytes on first use."""
        if name == "key":
            return self.keys.array  # one array for the tables that hold the same keys (`KeyIndex.adopt`)
        if name not in self._arrays:
            self._arrays[name] = self._parse(name)
        return self._arrays[name]

    def _parse(self, name: str) -> pa.Array:
        if self._full is not None:
            col = self._full.column(name)
        else:
            if name not in self.names:
                raise KeyError(name)
            col = read_column(self.dir, self._bytes, name, dictionary=name == "shard", narrow=NARROWER.get(name, ()),
                              record=True)
        col = col.combine_chunks()
        # the parse's scratch memory goes back to the system (the allocator keeps it otherwise: ~180 MB at 1M
        # samples, in every rank)
        release_memory()
        return col

    def forget(self, name: str) -> None:
        """Drop a parsed column that only opening or joining needed (e.g. `split`, `shard_nbytes`: ~8 MB each
        at 1M samples, private to every rank); a later `column(name)` parses it again. In a view over a given table
        too: its parsed columns are copies of the table's (`combine_chunks` copies), which the table still holds."""
        if name != "key":
            self._arrays.pop(name, None)
            self._cols.pop(name, None)

    def drop_replaced(self, name: str) -> None:
        """Drop a parsed column kept in another form since (the locator's crc numbers), in a view over a given
        table too (its parsed columns are copies)."""
        self._arrays.pop(name, None)

    @property
    def parsed(self) -> set[str]:
        """The columns parsed so far (kept as Arrow arrays: private memory of this process)."""
        return set(self._arrays) | {"key"}  # parsed on open, held by the key index

    @property
    def as_python(self) -> set[str]:
        """The columns kept as whole lists of Python objects (`values`, `keys.as_list`: for whole-table walks
        only)."""
        return set(self._cols) | ({"key"} if self.keys.listed else set())

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

    def __len__(self) -> int:
        return len(self.keys)

    # ------------------------------------------------------------ rows

    def meta_at(self, i: int) -> dict[str, Any]:
        """Sample i's meta columns, cell by cell: `values` would turn every meta column of the table into Python
        objects, kept (~1.8 GB at 1M samples in every encode rank, which asks one sample at a time)."""
        out = {c: self.cell(c, i) for c in self.meta_columns()}
        if self.is_v1:
            out["img_shapes"] = [list(s) for s in self.img_shapes_at(i)]
        return out

    def rows_at(self, rows: Iterable[int], columns: Iterable[str]) -> dict[int, dict[str, Any]]:
        """The named columns (those the table has) of a few rows, e.g. the captions of the samples evaluate shows:
        read from the manifest bytes a batch of rows at a time, only the row groups holding them (the others are
        neither decoded nor paged in), nothing kept. `cell` / `meta_at` parse each whole column and keep it, right
        for a walk over the table (encode asks every sample) but not for a few rows: every meta column of `images`
        is ~735 MB at 1M samples, in every rank. Columns parsed already are read from their arrays."""
        wanted = sorted(set(rows))
        out: dict[int, dict[str, Any]] = {i: {} for i in wanted}
        names = [c for c in dict.fromkeys(columns) if c in self.names]
        held = [c for c in names if c == "key" or c in self._arrays or c in self._cols or self._full is not None]
        for c in held:
            for i in wanted:
                out[i][c] = self.cell(c, i)
        rest = [c for c in names if c not in held]
        if rest and wanted:
            for i, row in self._groups().rows_at(wanted, rest, _ROWS_PER_BATCH).items():
                out[i].update(row)
        return out

    def table_at(self, rows: np.ndarray, columns: list[str] | None = None) -> pa.Table:
        """Every column (or the named `columns`) of the given rows (ascending row numbers), in that order, as the
        whole manifest's `take` would give them: read a row group at a time from the manifest bytes, only the groups
        holding them, so what is held is those rows and one group, not the whole manifest (every column of a 1M-row
        `text` or `vae` manifest is ~500 MB, parsed by each encode rank to keep its share: store/reuse.py
        `reusable`)."""
        if self._full is not None:
            full = self._full if columns is None else self._full.select(columns)
            return full.take(pa.array(rows, pa.int64()))
        try:
            return self._groups().table_at(rows, columns)
        finally:
            release_memory()  # the groups' decoded pages go back to the system

    def column_at(self, name: str, rows: np.ndarray) -> pa.Array:
        """`column(name).take(rows)` (rows in any order) without parsing the whole column: from its array where it
        is parsed already, else from the row groups holding those rows alone (`table_at`), nothing kept. The
        content id of a split's first rows (store/join.py) read every content column whole: ~170 MB of RSS at 1M
        samples for 256 rows."""
        if name == "key" or name in self._arrays:
            return self.column(name).take(pa.array(rows, pa.int64()))
        order = np.argsort(rows, kind="stable")
        got = self.table_at(np.asarray(rows, np.int64)[order], [name]).column(0).combine_chunks()
        return got.take(pa.array(np.argsort(order, kind="stable"), pa.int64()))

    def column_groups(self, name: str) -> Iterator[pa.Array]:
        """Column `name` a row group at a time (one group's values held at once, none kept): for a check over a
        whole column whose values are not wanted after it (`SampleLocator.crcs_at`)."""
        if self._full is not None:
            yield from self._full.column(name).chunks
            return
        if name in self._arrays:  # parsed already (one array: `column` combines its chunks)
            yield self.column(name)
            return
        for group in self._groups().groups([name]):
            yield group.column(0).combine_chunks()

    def _groups(self) -> ManifestGroups:
        """The checked manifest bytes opened for one read; a page found damaged is recorded, as `open` records a
        checksum mismatch (`manifest_files._reading`)."""
        return ManifestGroups(self._bytes, self.dir, record=True)

    def img_shapes_at(self, i: int) -> list[ImgShape]:
        if self.is_v1:
            row = {c: self.cell(c, i) for c in ("height", "width", "control_height", "control_width")
                   if c in self.names}
            return img_shapes_from_v1(row)
        return [tuple(s) for s in self.cell("img_shapes", i)]  # type: ignore[misc]
