"""A table version's schema.json and manifest.parquet, read and checked against its checksums.json: a damaged
file is a `DamagedData` (recorded), an unparsable one a clear error, never values read from damaged bytes. Used by
`ManifestView` (store/manifest_view.py) and by the one-off readers that need a manifest's rows but no reader."""

from __future__ import annotations

import bisect
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ContextManager, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.errors import UserError
from schemas.newer import WrittenByNewer, refuse_newer
from schemas.table import CURRENT_SCHEMA_VERSION, KNOWN_SCHEMA_VERSIONS, TableSchema
from store import format as fmt
from store import integrity
from store.integrity import DamagedData


def read_schema(vdir: Path, data: bytes | None = None, intact: bool = False) -> TableSchema:
    """The version's schema.json (`data`: its bytes, read already). `intact`: those bytes were checked against the
    version's checksums.json; a later schema version is then a newer release's (`WrittenByNewer`). Unchecked, it
    may be a flipped bit (`schemas.newer`): refused as a version this code does not read, damage or not."""
    if data is None:
        raw = fmt.read_json(vdir / fmt.SCHEMA_JSON, "schema.json")
    else:
        try:
            raw = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{vdir / fmt.SCHEMA_JSON} is not valid JSON ({e})") from None
    found = raw.get("schema_version") if isinstance(raw, dict) else None
    refuse_newer(str(vdir / fmt.SCHEMA_JSON), raw, CURRENT_SCHEMA_VERSION, intact=intact, key="schema_version")
    if found not in KNOWN_SCHEMA_VERSIONS:
        raise UserError(f"{vdir / fmt.SCHEMA_JSON}: expected schema version one of {KNOWN_SCHEMA_VERSIONS}, "
                        f"found {found!r}; use a pipeline release that reads it")
    try:
        return TableSchema.from_dict(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{vdir / fmt.SCHEMA_JSON}: not a valid table schema ({type(e).__name__}: {e})") from None


def checked_schema(vdir: Path, record: bool = True, sums: dict[str, dict[str, Any]] | None = None) -> TableSchema:
    """A complete version's schema.json, its bytes checked against checksums.json (when the version has one): for
    those that pick a version by what its schema says (`Store.find_version`, the split rule a resize keeps), where
    a flipped bit that still parses would name another lineage or setting. One that does not read (damaged,
    truncated, empty, unparsable, its checksums.json damaged) is recorded as damage, as a reader records it, and
    raised (`DamagedData`): the version is then treated as one `store verify` marked. A newer release's
    (`WrittenByNewer`) is raised as it is, never recorded. `record=False`: raised only (what writes nothing:
    `store inspect`, `store gc --dry-run`). A store URL's cached copy damaged on the node's disk is fetched again
    first, as a reader's open fetches it (store/manifest_view.py). `sums`: the version's checksums.json files as the
    caller read them already (inspect: with its counts), not read again; read again after a fetch."""
    from store.remote_shards import refetch_metadata

    given = sums
    for attempt in (1, 2):
        try:
            sums = integrity.read_version_checksums(vdir) if given is None or attempt == 2 else given
            return read_schema(vdir, integrity.read_checked(vdir, fmt.SCHEMA_JSON, sums), intact=sums is not None)
        except WrittenByNewer:
            raise
        except UserError as e:
            if record and attempt == 1 and refetch_metadata(vdir):
                continue
            found = e if isinstance(e, DamagedData) else \
                DamagedData(f"{integrity.where(vdir)}: {e}; {integrity.repair_hint(vdir, fmt.SCHEMA_JSON)}")
            if record:
                integrity.record_damage(vdir, problems=[str(found)])
            raise found from None
    raise AssertionError("unreachable")


def unreadable(vdir: Path, e: Exception) -> DamagedData:
    return DamagedData(f"{vdir / fmt.MANIFEST} is unreadable ({_one_line(e)}); {integrity.repair_hint(vdir)}")


def _one_line(e: Exception) -> str:
    return printable_line(f"{type(e).__name__}: {e}")


def printable_line(text: str) -> str:
    """A message as one printable line: pyarrow's parquet errors carry newlines and quote the damaged byte they met
    (a control character, which a terminal may act on), e.g. "don't know what type: \\x0f\\nDeserializing..."."""
    text = "".join(c if c.isprintable() or c.isspace() else c.encode("unicode_escape").decode() for c in text)
    return " ".join(text.split())


@contextmanager
def _reading(vdir: Path, record: bool = False) -> Iterator[None]:
    """A failed parquet read of the version's manifest bytes as the store's one line (`unreadable`). `record`: that
    line recorded as the version's damage (`integrity.record_damage`), as a reader's open records a checksum
    mismatch: the bytes passed their check, so a page that does not decode was damaged before they were
    checksummed, and the stage that wrote the version must not call it up to date on its rerun. Running out of
    memory is no damage (pyarrow's `ArrowMemoryError` is a MemoryError): raised as it is, nothing recorded."""
    try:
        yield
    except (DamagedData, MemoryError):  # DamagedData: turned (and recorded) already, by a read inside this one
        raise
    except Exception as e:  # noqa: BLE001
        found = unreadable(vdir, e)
        if record:
            integrity.record_damage(vdir, problems=[str(found)])
        raise found from None


class ManifestGroups:
    """A version's checked manifest bytes opened as parquet and read a row group at a time: the one place the
    manifest's row reads (`ManifestView`'s, `read_column`, `checked_groups`, verify's open) open them, and where a read
    that fails (a page damaged before its bytes were checksummed, bytes that are no parquet) becomes the store's
    one-line error naming the file. `data` may be the file's path: read as it is, in file reads (verify, which checks
    its bytes against checksums.json apart and decodes it either way, every page once: mapped, the whole manifest
    would stay in its RSS). Opened for each read, never kept: one parquet reader is not read by several threads at once.
    `dictionary`: the columns read dictionary-encoded. `record`: a failed read is recorded as the version's damage
    (a reader's view: `_reading`); the one-off readers that write nothing (inspect, repair's scan) leave it off."""

    def __init__(self, data: bytes | pa.Buffer | Path, vdir: Path, dictionary: list[str] | None = None,
                 record: bool = False) -> None:
        self.dir, self.record = vdir, record
        with _reading(vdir, record):
            source = data if isinstance(data, Path) else pa.BufferReader(data)
            self.file = pq.ParquetFile(source, read_dictionary=dictionary)
            self.names: list[str] = self.file.schema_arrow.names
            self.starts = row_group_starts(self.file)

    def reading(self) -> ContextManager[None]:
        return _reading(self.dir, self.record)

    def empty(self, columns: list[str] | None = None) -> pa.Table:
        """No rows of the named columns (or all), typed as the manifest's."""
        empty = self.file.schema_arrow.empty_table()
        return empty if columns is None else empty.select(columns)

    def groups(self, columns: list[str] | None) -> Iterator[pa.Table]:
        """The named columns (or all) a row group at a time; the caller's work between groups is its own (an error
        there is not the manifest's)."""
        for g in range(len(self.starts) - 1):
            with self.reading():
                group = self.file.read_row_group(g, columns=columns, use_threads=False)
            yield group

    def table_at(self, rows: np.ndarray, columns: list[str] | None = None) -> pa.Table:
        """The given rows (ascending row numbers) of the named columns (or all), read from the row groups holding
        them alone."""
        starts = np.asarray(self.starts, np.int64)
        group = np.searchsorted(starts, rows, side="right") - 1
        with self.reading():
            parts = [self.file.read_row_group(int(g), columns=columns, use_threads=False)
                     .take(pa.array(rows[group == g] - starts[g])) for g in np.unique(group)]
            return pa.concat_tables(parts) if parts else self.empty(columns)

    def rows_at(self, wanted: list[int], columns: list[str], batch_rows: int) -> dict[int, dict[str, Any]]:
        """Each of the `wanted` rows (ascending, no repeats) as {column: value}: only the row groups holding them
        are read, each `batch_rows` rows at a time up to its last wanted row."""
        out: dict[int, dict[str, Any]] = {}
        with self.reading():
            for g in sorted({bisect.bisect_right(self.starts, i) - 1 for i in wanted}):
                start = self.starts[g]
                mine = wanted[bisect.bisect_left(wanted, start):bisect.bisect_left(wanted, self.starts[g + 1])]
                for batch in self.file.iter_batches(batch_rows, row_groups=[g], columns=columns):
                    inside = mine[bisect.bisect_left(mine, start):bisect.bisect_left(mine, start + batch.num_rows)]
                    if inside:
                        out.update(zip(inside, batch.take(pa.array([i - start for i in inside])).to_pylist()))
                    start += batch.num_rows
                    if start > mine[-1]:
                        break
        return out


def read_manifest(vdir: Path, data: bytes | pa.Buffer, columns: list[str] | None = None,
                  read_dictionary: list[str] | None = None, record: bool = False) -> pa.Table:
    """Parse (some columns of) checked manifest bytes; undecodable parquet is one clear error, not a traceback
    (`record`: recorded as the version's damage, `_reading`)."""
    with _reading(vdir, record):
        return pq.read_table(pa.BufferReader(data), columns=columns, read_dictionary=read_dictionary)


def read_column(vdir: Path, data: bytes | pa.Buffer, name: str, dictionary: bool = False,
                narrow: tuple[pa.DataType, ...] = (), record: bool = False) -> pa.ChunkedArray:
    """One column of checked manifest bytes, decoded a row group at a time (`dictionary`: as dictionary-encoded;
    `narrow`: each group cast as `arrow_columns.narrowed` casts a column, all then in the widest type a group
    needed, as the whole column's cast would give; `record`: a failed read recorded, `_reading`). A whole-column
    read decodes every group's pages at once, and what it frees stays scattered among the kept values in the memory
    pool: at 1M keys (34 MB) a rank kept ~85 MB after it, ~40 MB read group by group; img_shapes was decoded whole
    as int64 before its cast to int16 (bench/train_startup.py)."""
    from store.arrow_columns import narrowed

    groups = ManifestGroups(data, vdir, dictionary=[name] if dictionary else None, record=record)
    # each group's read is the manifest's (`groups`); the narrowing between them is this caller's own work
    chunks = [narrowed(c, narrow) if narrow else c for group in groups.groups([name]) for c in group.column(0).chunks]
    if not chunks:  # no row groups, or groups of no rows (an empty table's commit)
        return groups.empty().column(name)
    if narrow:  # the types are tried narrowest first: a later one holds every earlier one's values
        rank = {t: i for i, t in enumerate(narrow)}
        wide = max((c.type for c in chunks), key=lambda t: rank.get(t, len(narrow)))
        chunks = [c if c.type == wide else c.cast(wide) for c in chunks]
    return pa.chunked_array(chunks)


def row_group_starts(f: pq.ParquetFile) -> list[int]:
    """The first row of each row group of `f`, then its row count: row i lies in group
    `bisect.bisect_right(starts, i) - 1`. From the footer alone (`fmt.ROW_GROUP_ROWS` rows a group in manifests
    written now, one group in those written before)."""
    md = f.metadata
    starts = [0]
    for g in range(md.num_row_groups):
        starts.append(starts[-1] + md.row_group(g).num_rows)
    return starts


def checked_manifest(vdir: Path, columns: list[str] | None = None, record: bool = False) -> pa.Table:
    """A complete version's manifest (the named columns it has, or all), its bytes checked against
    checksums.json first: a damaged manifest is a `DamagedData`, never rows read from damaged bytes. For the
    one-off readers (reuse, migrate, inspect, train's dropped report) that need the rows but no `TableReader`.
    Memory-mapped, as a reader's: every rank opening training reads the `images` manifest (hundreds of MB at 1M
    samples), one copy in the page cache rather than a private one each. `record`: damage found (a checksum
    mismatch, a page that does not decode) recorded as a reader records it (`_checked_map`, `_reading`)."""
    groups = ManifestGroups(_checked_map(vdir, record), vdir, record=record)  # its footer parsed once
    if columns is not None:
        names = set(groups.names)
        columns = [c for c in columns if c in names]
    with groups.reading():
        return groups.file.read(columns=columns)


def checked_groups(vdir: Path, columns: list[str], record: bool = False) -> Iterator[pa.Table]:
    """`checked_manifest`'s columns (those the version has), a row group at a time: what a caller holds is one
    group's rows, not the whole columns (every rank's start reads the `images` keys and splits: ~45 MB of Arrow
    arrays at 1M samples, and their decode's scratch, for a few keys kept). `record`: as `checked_manifest`'s."""
    groups = ManifestGroups(_checked_map(vdir, record), vdir, record=record)
    names = set(groups.names)
    yield from groups.groups([c for c in columns if c in names])


def _checked_map(vdir: Path, record: bool) -> pa.Buffer:
    """The version's manifest memory-mapped and checked (`mapped_checked`); `record`: damage found (its checksums.json
    or the manifest damaged, missing) recorded, as a reader's open records it, so that the rerun of the stage that
    wrote the version does not call it up to date."""
    try:
        return mapped_checked(vdir, fmt.MANIFEST, integrity.read_version_checksums(vdir))
    except DamagedData as e:
        if record:
            integrity.record_damage(vdir, problems=[str(e)])
        raise


def mapped_checked(vdir: Path, name: str, sums: dict[str, dict[str, Any]] | None) -> pa.Buffer:
    """A file of the version memory-mapped read-only, checked against checksums.json when the version has one."""
    try:
        mapped = pa.memory_map(os.path.join(str(vdir), name))
    except FileNotFoundError:
        raise DamagedData(f"{integrity.where(vdir)}: {name} is missing; {integrity.repair_hint(vdir, name)}") from None
    data = mapped.read_buffer()  # holds the map open for as long as the buffer (or a column sliced from it) lives
    mapped.close()  # the descriptor: the buffer keeps the map itself
    if sums is not None:
        with memoryview(data) as mv:
            integrity.check_bytes(vdir, name, mv, sums)
    return data
