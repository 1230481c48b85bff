"""The commit's merge streams the manifest (`store.manifest.merge_runs`: rows sorted a run at a time into parquet
bytes, then written row group by row group) instead of holding it decoded: the file it writes must be, byte for
byte, the one the former merge wrote (`bench/merge_memory.py` `old_merged`, every index held and sorted at once),
with rows spread over many runs, run row groups and manifest row groups."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.merge_memory import old_merged
from schemas.errors import UserError
from store import format as fmt
from store import manifest
from store.manifest import FILE_STRUCT, TENSOR_STRUCT


def _rows(shard: str, keys: list[str], meta: dict | None = None, offset: int = 0) -> pa.Table:
    n = len(keys)
    cols = {
        "key": pa.array(keys, pa.string()),
        "shard": pa.array([shard] * n, pa.string()),
        "shard_sha256": pa.array([hashlib.sha256(shard.encode()).hexdigest()] * n, pa.string()),
        "shard_nbytes": pa.array([1000 + len(shard)] * n, pa.int64()),
        "sample_offset": pa.array([offset + 512 * i for i in range(n)], pa.int64()),
        "sample_nbytes": pa.array([512] * n, pa.int64()),
        "sample_sha256": pa.array([hashlib.sha256(k.encode()).hexdigest() for k in keys], pa.string()),
        "tensors": pa.array([[{"name": "x", "offset": offset + 512 * i, "nbytes": 8, "dtype": "float32",
                               "shape": [2, len(k) % 3 + 1]}] for i, k in enumerate(keys)], pa.list_(TENSOR_STRUCT)),
        "files": pa.array([[] for _ in keys], pa.list_(FILE_STRUCT)),
        "shard_crc32c": pa.array([f"{len(shard):08x}"] * n, pa.string()),
        "sample_crc32c": pa.array([k[:8] for k in keys], pa.string()),
        "split": pa.array(["val" if int(k[0], 16) < 2 else "train" for k in keys], pa.string()),
    }
    for name, values in (meta or {}).items():
        cols[name] = pa.array(values)
    return pa.table(cols)


def _indexes(tmp_path: Path) -> list[Path]:
    """3 ranks x 6 shards of 0-25 random keys; a meta column some shards lack and one holds only nulls; a sample of
    rank 1 written again (same content) in a later shard of that rank."""
    rng = np.random.default_rng(7)
    paths, again = [], None
    for r in range(3):
        for j in range(6):
            n = int(rng.integers(0, 26))
            keys = [hashlib.sha256(f"{r}-{j}-{i}".encode()).hexdigest()[:32] for i in range(n)]
            meta = {} if j % 3 == 0 else {"note": [None] * n if j == 4 else [f"n{r}{j}{i}" for i in range(n)]}
            if (r, j) == (1, 5):
                keys.append(again)
                if meta:
                    meta["note"] = [*meta["note"], "kept"]
            elif (r, j) == (1, 2) and n:
                again = keys[0]
                meta["note"][0] = "kept"
            shard = fmt.shard_name(r, j)
            p = tmp_path / fmt.index_name(shard)
            pq.write_table(_rows(shard, keys, meta, offset=1000 * j), p)
            paths.append(p)
    return paths


@pytest.fixture
def small(monkeypatch) -> None:
    """Runs, run row groups and manifest row groups of a few rows: every row group of the file drawn from several
    runs, each run's groups decoded across group boundaries."""
    monkeypatch.setattr(manifest, "JOINED_INDEXES", 3)
    monkeypatch.setattr(manifest, "RUN_ROWS", 40)
    monkeypatch.setattr(manifest, "RUN_GROUP_ROWS", 4)
    monkeypatch.setattr(fmt, "ROW_GROUP_ROWS", 16)


def test_the_streamed_manifest_is_the_former_merges_file_byte_for_byte(tmp_path: Path, small) -> None:
    paths = _indexes(tmp_path)
    want = old_merged([pq.read_table(p) for p in paths])
    merged = manifest.merge_runs(paths)
    assert len(merged.runs) >= 4 and merged.num_rows == want.num_rows > 5 * fmt.ROW_GROUP_ROWS
    buf = io.BytesIO()
    written = merged.write(buf)
    data = buf.getvalue()
    assert data == fmt.parquet_bytes(want)
    assert written.measured == (f"{__import__('crc32c').crc32c(data):08x}", len(data))
    # checksums.json's shards: each shard the manifest names once, with its size and CRC32C
    want_shards = want.select(["shard", "shard_crc32c", "shard_nbytes"]).to_pylist()
    assert sorted(written.shards.to_pylist(), key=lambda d: d["shard"]) == \
        sorted({d["shard"]: d for d in want_shards}.values(), key=lambda d: d["shard"])
    assert manifest.merge_indexes(paths).equals(want)  # `store repair`'s table: the same rows


def test_a_duplicate_of_other_content_in_another_run_is_still_refused(tmp_path: Path, small) -> None:
    paths = _indexes(tmp_path)
    rows = pq.read_table(paths[-1])
    key = pq.read_table(paths[0]).column("key")[0].as_py()  # rank 0's first shard: another run than rank 2's last
    rows = pa.concat_tables([rows, _rows(fmt.shard_name(2, 5), [key], offset=99_000).select(rows.column_names)
                             if "note" not in rows.column_names else
                             _rows(fmt.shard_name(2, 5), [key], {"note": ["x"]}, offset=99_000)])
    pq.write_table(rows, paths[-1])
    with pytest.raises(UserError, match=rf"duplicate keys across shards: {key} in {fmt.shard_name(0, 0)} and "
                                        rf"{fmt.shard_name(2, 5)}: each sample"):
        manifest.merge_runs(paths)


def test_no_rows_writes_the_former_empty_manifest(tmp_path: Path) -> None:
    p = tmp_path / fmt.index_name(fmt.shard_name(0, 0))
    pq.write_table(_rows(fmt.shard_name(0, 0), []), p)
    buf = io.BytesIO()
    manifest.merge_runs([p]).write(buf)
    assert buf.getvalue() == fmt.parquet_bytes(old_merged([pq.read_table(p)]))
    buf = io.BytesIO()
    manifest.merge_runs([]).write(buf)
    assert buf.getvalue() == fmt.parquet_bytes(old_merged([]))
