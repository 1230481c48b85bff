"""Manifest rows <-> Arrow: the locating columns every table has, plus the table's own meta columns."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas.errors import UserError
from store.checksum import crc_hex
from store.shard import SampleRecord

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
# shard indexes whose rows a merge joins into one table as it reads them (~50-100k rows): a merge's memory is
# then ~one copy of the rows in a few large buffers, not ~20-30k indexes' small ones (bench/merge_memory.py)
JOINED_INDEXES = 256


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
    """Concatenate per-shard indexes into one manifest sorted by key; with it, each index file's name -> (crc32c,
    nbytes) of the bytes read, for the commit's checksums.json.

    A key in two shards of one rank with the same content (every column but `WHERE_COLUMNS`: the sample's bytes,
    whose sha256 covers its meta, and the meta columns) keeps the earlier shard's row: a resumed writer whose view
    of a shared folder hid the first shard's index wrote the sample again, and the later shard's other rows stay.
    Any other duplicate key (two ranks, or other content) is an error naming both shards. `check`: as in
    `read_indexes`."""
    paths = list(paths)
    measured: dict[str, tuple[str, int]] = {}
    parts = []
    for i in range(0, len(paths), JOINED_INDEXES):
        batch = paths[i:i + JOINED_INDEXES]
        reads = read_indexes(batch, check=check)
        measured.update((p.name, r.measured) for p, r in zip(batch, reads))
        # one chunk per column for the batch: the indexes' small buffers freed now (and reused by the next batch's),
        # not held, scattered, until the end of the merge
        parts.append(pa.concat_tables([r.rows for r in reads], promote_options="permissive").combine_chunks())
        del reads
    return _merged(parts), measured  # `_merged` releases each part's columns as it goes: nothing else holds them


def _merged(parts: list[pa.Table]) -> pa.Table:
    """The parts' rows sorted by key (then shard), duplicates dropped or refused (`merge_measured`). Empties `parts`.

    Sorted one column at a time: each column's chunks joined, taken in key order and dropped from the parts, so
    that the parts' copy shrinks as the sorted one grows (~one copy of the rows, not two plus a column's joined
    chunks: bench/merge_memory.py); the order from the key and shard columns joined, not over their chunks."""
    if not parts:
        return empty_manifest()
    table = pa.concat_tables(parts, promote_options="permissive")
    parts.clear()
    keys = table.column("key").combine_chunks()
    order = pc.sort_indices(pa.table({"key": keys, "shard": table.column("shard").combine_chunks()}),
                            sort_keys=[("key", "ascending"), ("shard", "ascending")])  # a rank's shards: by number
    schema, columns = table.schema, []
    for name in schema.names:
        column = keys if name == "key" else table.column(name).combine_chunks()
        table = table.drop_columns([name])
        columns.append(column.take(order))
        del column
    del keys
    table = pa.Table.from_arrays(columns, schema=schema)
    del columns
    keys = table.column("key").combine_chunks()
    # rows whose key is the one before (sorted): found in Arrow, not as a Python str per row
    again = np.flatnonzero(pc.equal(keys.slice(1), keys.slice(0, len(keys) - 1)).to_numpy(zero_copy_only=False)) + 1 \
        if len(keys) > 1 else np.zeros(0, np.int64)
    if not len(again):
        return table
    content = [c for c in table.column_names if c not in WHERE_COLUMNS]
    later = table.take(pa.array(again)).to_pylist()
    earlier = table.take(pa.array(again - 1)).to_pylist()
    for a, b in zip(earlier, later):
        if _rank(a["shard"]) != _rank(b["shard"]) or any(a[c] != b[c] for c in content):
            raise UserError(
                f"duplicate keys across shards: {a['key']} in {a['shard']} and {b['shard']}"
                f"{' (other content)' if _rank(a['shard']) == _rank(b['shard']) else ''}: each sample must be "
                "written once; nothing committed. Delete the later shard's .tar and .index.parquet, then rerun: "
                "its samples are written again")
    keep = np.ones(len(keys), bool)
    keep[again] = False
    return table.filter(pa.array(keep))


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
