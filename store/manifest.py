"""Manifest rows <-> Arrow: the locating columns every table has, plus the table's own meta columns."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas.errors import UserError
from store import format as fmt
from store.checksum import RunningCrc, crc_hex
from store.shard import SampleRecord
from store.version_counts import COUNTED, Tally

TENSOR_STRUCT = pa.struct([
    ("name", pa.string()), ("offset", pa.int64()), ("nbytes", pa.int64()),
    ("dtype", pa.string()), ("shape", pa.list_(pa.int64())),
])
FILE_STRUCT = pa.struct([("name", pa.string()), ("offset", pa.int64()), ("nbytes", pa.int64())])
LOCATING_FIELDS = [
    pa.field("key", pa.string(), nullable=False),
    pa.field("shard", pa.string(), nullable=False),  # file name inside the version folder
    pa.field("shard_sha256", pa.string(), nullable=False),  # of the whole shard file
    pa.field("shard_nbytes", pa.int64(), nullable=False),
    pa.field("sample_offset", pa.int64(), nullable=False),  # first byte of the sample's first tar header
    pa.field("sample_nbytes", pa.int64(), nullable=False),  # through the end of its last member's padding
    pa.field("sample_sha256", pa.string(), nullable=False),  # of those bytes
    pa.field("tensors", pa.list_(TENSOR_STRUCT), nullable=False),  # offsets are absolute within the shard
    pa.field("files", pa.list_(FILE_STRUCT), nullable=False),
]
LOCATING_COLUMNS = frozenset(f.name for f in LOCATING_FIELDS)
# Store format 2 (absent in format-1 versions, which readers check against `sample_sha256` instead):
CHECKSUM_FIELDS = [
    pa.field("shard_crc32c", pa.string(), nullable=False),  # of the whole shard file
    pa.field("sample_crc32c", pa.string(), nullable=False),  # of the sample's bytes; checked on every first read
]
CHECKSUM_COLUMNS = frozenset(f.name for f in CHECKSUM_FIELDS)
RESERVED_COLUMNS = LOCATING_COLUMNS | CHECKSUM_COLUMNS


def rows_to_table(
    records: list[SampleRecord], metas: list[dict[str, Any]], shard: str, shard_sha256: str, shard_nbytes: int,
    shard_crc32c: str,
) -> pa.Table:
    n = len(records)
    cols: dict[str, pa.Array] = {
        "key": pa.array([r.key for r in records], pa.string()),
        "shard": pa.array([shard] * n, pa.string()),
        "shard_sha256": pa.array([shard_sha256] * n, pa.string()),
        "shard_nbytes": pa.array([shard_nbytes] * n, pa.int64()),
        "sample_offset": pa.array([r.sample_offset for r in records], pa.int64()),
        "sample_nbytes": pa.array([r.sample_nbytes for r in records], pa.int64()),
        "sample_sha256": pa.array([r.sample_sha256 for r in records], pa.string()),
        "tensors": pa.array([r.tensors for r in records], pa.list_(TENSOR_STRUCT)),
        "files": pa.array([r.files for r in records], pa.list_(FILE_STRUCT)),
        "shard_crc32c": pa.array([shard_crc32c] * n, pa.string()),
        "sample_crc32c": pa.array([r.sample_crc32c for r in records], pa.string()),
    }
    meta_names: dict[str, None] = {}
    for m in metas:
        meta_names.update(dict.fromkeys(m))
    for name in meta_names:
        try:
            cols[name] = pa.array([m.get(name) for m in metas])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise UserError(f"meta column {name!r} has values of mixed types in shard {shard}: {e}") from None
    schema = pa.schema(LOCATING_FIELDS + CHECKSUM_FIELDS + [pa.field(k, cols[k].type) for k in meta_names])
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def empty_manifest() -> pa.Table:
    return pa.schema(LOCATING_FIELDS + CHECKSUM_FIELDS).empty_table()


# Columns that say where a sample's bytes are, not what they are: a sample written twice differs only in these
WHERE_COLUMNS = frozenset({"shard", "shard_sha256", "shard_nbytes", "shard_crc32c", "sample_offset", "tensors", "files"})


# shard indexes read at a time by a commit: parquet decoding releases the GIL, and on a shared file system each
# file is a round trip or more
INDEX_READERS = 8
# shard indexes a merge reads at a time (~2-20k rows), each batch's rows then sorted into the current run
JOINED_INDEXES = 64


class IndexRead(NamedTuple):
    """One shard index as a commit read it: its rows, and the (crc32c, nbytes) of the very bytes they were parsed
    from, for checksums.json (`store.integrity.write_version_checksums`): each index read once, not again to be
    checksummed (~6,000 files at 1M samples; on a shared file system, round trips each)."""
    rows: pa.Table
    measured: tuple[str, int]


def read_indexes(paths: Iterable[Path], columns: Iterable[str] | None = None,
                 check: Callable[[Path, tuple[str, int]], None] | None = None) -> list[IndexRead]:
    """Each shard index whole (or the named `columns` it has), in order, `INDEX_READERS` at a time, through
    pq.ParquetFile over its bytes read in one go (about half of pq.read_table's cost per file): a commit reads one
    per shard, ~20-30k at 1M samples (one after the other, ~2 ms each, up to a minute while every rank waits:
    bench/commit_indexes.py). `check(path, (crc32c, nbytes))` judges those bytes before they are parsed (repair:
    against checksums.json), so that no caller reads an index once to check it and again to use it."""
    wanted = None if columns is None else list(columns)

    def read(p: Path) -> IndexRead:
        try:
            data = p.read_bytes()
            measured = (crc_hex(data), len(data))
            if check is not None:  # damaged bytes are named as damage, never parsed
                check(p, measured)
            with pq.ParquetFile(pa.py_buffer(data)) as f:
                cols = None if wanted is None else [c for c in wanted if c in f.schema_arrow.names]
                return IndexRead(f.read(columns=cols, use_threads=False), measured)
        except (OSError, pa.ArrowException) as e:  # ParquetFile's errors do not name the file
            raise UserError(f"{p}: the shard index is unreadable ({e}); rerun the stage that wrote it (its "
                            "shard is written again) or `pipeline store repair`") from None

    paths = list(paths)
    if len(paths) < 2:
        return [read(p) for p in paths]
    with ThreadPoolExecutor(min(INDEX_READERS, len(paths))) as pool:
        return list(pool.map(read, paths))


def merge_indexes(paths: Iterable[Path]) -> pa.Table:
    """`merge_measured`'s manifest alone."""
    return merge_measured(paths)[0]


def merge_measured(paths: Iterable[Path], check: Callable[[Path, tuple[str, int]], None] | None = None,
                   ) -> tuple[pa.Table, dict[str, tuple[str, int]]]:
    """The manifest of `merge_runs` as one table (`store repair`, tests: a commit streams it, `MergedIndexes.write`);
    with it, each index file's name -> (crc32c, nbytes) of the bytes read."""
    merged = merge_runs(paths, check)
    return pa.concat_tables(list(merged.groups()), promote_options="none"), merged.measured


# rows of the indexes sorted together into one run, and rows per parquet row group of a run's encoded bytes: the
# merge holds each run encoded (LZ4: ~1/4 of its Arrow size, decoded ~3x faster than snappy), and decodes ~one
# such group per run at a time. The peak beyond the runs: ~2 runs' rows decoded while one is sorted, and while the
# manifest is written, one row group of it plus ~RUN_GROUP_ROWS rows per run (~1M / RUN_ROWS runs)
RUN_ROWS = 32_768
RUN_GROUP_ROWS = 1_024


def merge_runs(paths: Iterable[Path], check: Callable[[Path, tuple[str, int]], None] | None = None,
               ) -> MergedIndexes:
    """Per-shard indexes merged into one manifest sorted by key (then shard), ready to be written row group by row
    group (`MergedIndexes.write`); each index file's name -> (crc32c, nbytes) of the bytes read, for the commit's
    checksums.json, in its `measured`.

    A key in two shards of one rank with the same content (every column but `WHERE_COLUMNS`: the sample's bytes,
    whose sha256 covers its meta, and the meta columns) keeps the earlier shard's row: a resumed writer whose view
    of a shared folder hid the first shard's index wrote the sample again, and the later shard's other rows stay.
    Any other duplicate key (two ranks, or other content) is an error naming both shards. `check`: as in
    `read_indexes`.

    An external merge in memory: the indexes are read `JOINED_INDEXES` at a time, their rows sorted `RUN_ROWS` at a
    time into runs held as parquet bytes; only the key and shard columns stay decoded, for the order of all rows.
    The whole manifest is never in memory (~1 GB at 1M samples; bench/merge_memory.py)."""
    paths = list(paths)
    measured: dict[str, tuple[str, int]] = {}
    runs: list[bytes] = []
    schemas: list[pa.Schema] = []
    keys: list[pa.ChunkedArray] = []  # per run, its rows' keys and shards (sorted)
    shards: list[pa.Array] = []
    pending: list[pa.Table] = []

    def flush() -> None:
        rows = pa.concat_tables(pending, promote_options="permissive").combine_chunks()  # a take over one chunk
        pending.clear()
        rows = rows.take(pc.sort_indices(rows, sort_keys=[("key", "ascending"), ("shard", "ascending")]))
        keys.append(rows.column("key"))
        shards.append(pc.dictionary_encode(rows.column("shard").combine_chunks()))
        sink = pa.BufferOutputStream()
        pq.write_table(rows, sink, row_group_size=RUN_GROUP_ROWS, compression="lz4")
        runs.append(sink.getvalue().to_pybytes())  # bytes of their own: freed whole, not amid Arrow's pool
        schemas.append(rows.schema)

    for i in range(0, len(paths), JOINED_INDEXES):
        batch = paths[i:i + JOINED_INDEXES]
        reads = read_indexes(batch, check=check)
        measured.update((p.name, r.measured) for p, r in zip(batch, reads))
        pending.extend(r.rows for r in reads)
        del reads
        if sum(t.num_rows for t in pending) >= RUN_ROWS:
            flush()
    if pending:
        flush()
    return MergedIndexes(runs, schemas, keys, shards, measured)


class Written(NamedTuple):
    """A streamed manifest's (crc32c, nbytes), for checksums.json, one row per shard its rows refer to (shard,
    shard_nbytes and, format 2, shard_crc32c: what checksums.json lists of the shards), and what `store inspect`
    shows of it, counted from its row groups as they were written (`store.version_counts`)."""
    measured: tuple[str, int]
    shards: pa.Table
    counts: dict[str, Any]


class MergedIndexes:
    """`merge_runs`' result: the runs (each a key-sorted slice of the rows, as parquet bytes) and the manifest's
    rows as (run, row in run) in key order, duplicates dropped or refused."""

    def __init__(self, runs: list[bytes], schemas: list[pa.Schema], keys: list[pa.ChunkedArray],
                 shards: list[pa.Array], measured: dict[str, tuple[str, int]]) -> None:
        self.runs, self.measured = runs, measured
        # the schema `pa.concat_tables(every index, promote_options="permissive")` has
        self.schema = pa.unify_schemas(schemas, promote_options="permissive") if schemas else empty_manifest().schema
        self._files = [pq.ParquetFile(pa.BufferReader(b)) for b in runs]
        self._firsts = [np.cumsum([0] + [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)])
                        for f in self._files]
        sizes = np.array([len(k) for k in keys], np.int64)
        order, again = _key_order(keys, shards)
        del keys, shards
        run = np.repeat(np.arange(len(runs), dtype=np.int32), sizes)[order]
        row = order - np.concatenate([[0], np.cumsum(sizes)])[run]
        del order
        if len(again):
            self._check_duplicates(run, row, again)
            keep = np.ones(len(run), bool)
            keep[again] = False
            run, row = run[keep], row[keep]
        self.run_of, self.row_of = run, row
        self.num_rows = len(run)
        self.nbytes = sum(len(b) for b in runs)  # ~the manifest's size: its rows, encoded alike

    def _decoded(self, r: int, groups: list[int]) -> tuple[pa.Table, np.ndarray]:
        """Run `r`'s row groups `groups` (increasing) decoded, and where each starts in the result."""
        sizes = np.diff(self._firsts[r])[groups]
        return (self._files[r].read_row_groups(groups, use_threads=False),
                np.concatenate([[0], np.cumsum(sizes)])[:-1])

    def _rows(self, run: np.ndarray, row: np.ndarray) -> list[dict[str, Any]]:
        """The rows at (run, row) pairs as dicts, in the order given (the duplicates' check: a few rows)."""
        out: list[dict[str, Any]] = [{}] * len(run)
        for r in np.unique(run).tolist():
            at = np.flatnonzero(run == r)
            group = np.searchsorted(self._firsts[r], row[at], side="right") - 1
            groups = np.unique(group)
            table, starts = self._decoded(r, groups.tolist())
            take = starts[np.searchsorted(groups, group)] + row[at] - self._firsts[r][group]
            for i, d in zip(at.tolist(), table.take(pa.array(take)).to_pylist()):
                out[i] = d
        return out

    def _check_duplicates(self, run: np.ndarray, row: np.ndarray, again: np.ndarray) -> None:
        content = [c for c in self.schema.names if c not in WHERE_COLUMNS]
        later, earlier = self._rows(run[again], row[again]), self._rows(run[again - 1], row[again - 1])
        for a, b in zip(earlier, later):
            if _rank(a["shard"]) != _rank(b["shard"]) or any(a.get(c) != b.get(c) for c in content):
                raise UserError(
                    f"duplicate keys across shards: {a['key']} in {a['shard']} and {b['shard']}"
                    f"{' (other content)' if _rank(a['shard']) == _rank(b['shard']) else ''}: each sample must be "
                    "written once; nothing committed. Delete the later shard's .tar and .index.parquet, then rerun: "
                    "its samples are written again")

    def groups(self) -> Iterator[pa.Table]:
        """The manifest in key order, `fmt.ROW_GROUP_ROWS` rows at a time (one row group of the written file each),
        of `schema`: each run's rows for a group decoded from the few row groups of the run that hold them, kept
        while the next group may need them."""
        if not self.num_rows:
            yield self.schema.empty_table()
            return
        held: list[dict[int, pa.Table]] = [{} for _ in self.runs]  # per run: its decoded row groups, by number
        empty = self.schema.empty_table()
        for g0 in range(0, self.num_rows, fmt.ROW_GROUP_ROWS):
            run, row = self.run_of[g0:g0 + fmt.ROW_GROUP_ROWS], self.row_of[g0:g0 + fmt.ROW_GROUP_ROWS]
            windows, take, offset = [empty], np.empty(len(run), np.int64), 0
            for r in np.unique(run).tolist():
                at = np.flatnonzero(run == r)
                rows = row[at]  # increasing: a run is sorted, and so is the manifest
                firsts = self._firsts[r]
                lo = int(np.searchsorted(firsts, rows[0], side="right")) - 1
                hi = int(np.searchsorted(firsts, rows[-1], side="right"))
                for g in range(lo, hi):  # each its own buffers: the one kept for the next group holds no others
                    if g not in held[r]:
                        held[r][g] = self._files[r].read_row_group(g, use_threads=False)
                windows.extend(held[r][g] for g in range(lo, hi))
                take[at] = offset + rows - firsts[lo]
                offset += int(firsts[hi] - firsts[lo])
            window = pa.concat_tables(windows, promote_options="permissive")
            del windows
            for h in held:  # a later group's rows of a run start in its last group used, or after it
                for g in sorted(h)[:-1]:
                    del h[g]
            # taken one column at a time over the windows' chunks, each column of the windows freed once taken:
            # ~one copy of the group's rows, in manifest order
            index, names, columns = pa.array(take), window.schema.names, []
            for name in names:
                columns.append(window.column(name).take(index))
                window = window.drop_columns([name])
            out = pa.Table.from_arrays(columns, names=names)
            del columns
            yield out if out.schema == self.schema else out.cast(self.schema)

    def write(self, f: BinaryIO) -> Written:
        """The manifest's parquet into the open file `f`, one row group at a time: the bytes `fmt.parquet_bytes`
        writes for the whole table, never all in memory."""
        sink = _CountingSink(f)
        cols = [c for c in ("shard", "shard_crc32c", "shard_nbytes") if c in self.schema.names]
        shards, tally = [], Tally()
        with pq.ParquetWriter(sink, self.schema) as writer:
            for group in self.groups():
                writer.write_table(group, row_group_size=fmt.ROW_GROUP_ROWS)
                shards.append(_first_of_each(group.select(cols)))
                tally.add(group.select([c for c in COUNTED if c in group.column_names]))
        return Written((sink.crc.hex(), sink.nbytes), _first_of_each(pa.concat_tables(shards)), tally.record())


class _CountingSink:
    """A file object's writes, counted and CRC32C'd on the way (pyarrow writes through its `write`)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.crc, self.nbytes, self.closed = f, RunningCrc(), 0, False

    def write(self, data: bytes) -> int:
        self.crc.update(data)
        self.nbytes += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:  # the caller closes `f`
        self.closed = True


def _first_of_each(rows: pa.Table) -> pa.Table:
    """`rows`' first row of each value of its first column, in order of first appearance."""
    codes = pc.dictionary_encode(rows.column(0).combine_chunks()).indices.to_numpy(zero_copy_only=False)
    _, first = np.unique(codes, return_index=True)
    return rows.take(pa.array(np.sort(first)))


def _key_order(keys: list[pa.ChunkedArray], shards: list[pa.Array]) -> tuple[np.ndarray, np.ndarray]:
    """Positions in the runs' rows joined, in (key, shard) order (a stable sort, as `Table.sort_by`), and the sorted
    positions whose key is the one before's. A shard sorts by its name's place among all names (a rank's shards: by
    number), an int32 per row, not the name again."""
    names = pa.chunked_array([s.dictionary for s in shards], pa.string()).unique().sort()
    shard = pa.chunked_array([pc.index_in(s.dictionary, names).take(s.indices) for s in shards], pa.int32())
    key = pa.chunked_array([c for k in keys for c in k.chunks], pa.string())
    order = pc.sort_indices(pa.table({"key": key, "shard": shard}),
                            sort_keys=[("key", "ascending"), ("shard", "ascending")]).to_numpy().astype(np.int64)
    del shard
    again, step = [], fmt.ROW_GROUP_ROWS
    for a in range(0, max(len(order) - 1, 0), step):  # the keys in order a slice at a time, not a copy of them all
        ordered = key.take(pa.array(order[a:a + step + 1]))
        same = pc.equal(ordered.slice(1), ordered.slice(0, len(ordered) - 1)).to_numpy(zero_copy_only=False)
        again.append(np.flatnonzero(same) + a + 1)
    return order, np.concatenate(again) if again else np.zeros(0, np.int64)


def rows_by_shard(rows: pa.Table) -> dict[str, pa.Table]:
    """Each shard's rows (in their order: a stable sort), as zero-copy slices of one sorted copy: a filter or a take
    per shard reads every row each time, O(shards x rows), minutes over a million samples in tens of thousands of
    shards (and a take from a manifest as read, one chunk per row group, joins its chunks first every time)."""
    rows = rows.take(pc.sort_indices(rows, sort_keys=[("shard", "ascending")]))
    names = rows.column("shard").to_pylist()
    starts = [i for i in range(len(names)) if i == 0 or names[i] != names[i - 1]]
    return {names[a]: rows.slice(a, b - a) for a, b in zip(starts, [*starts[1:], len(names)])}


def _rank(shard: str) -> str:
    return shard.split("-")[1]  # shard-rRR-NNNNNN.tar
