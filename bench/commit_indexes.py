"""A table version's commit at scale (`store.manifest.merge_indexes`, rank 0 while every other rank waits; also a
store URL's commit and `store repair`'s rebuilt manifest): every shard's index read and merged into the manifest.
An encode table of 1M samples has ~20-30k shards (bench/store_scale.py's ~256 MB shards), one index each.

Writes --samples manifest rows (the columns an encode-vae index holds: locating and checksum columns, two tensors
per sample, img_shapes, split) as index files of --per-shard rows in --dir (reused on reruns), then measures, in
the same run (best of --repeat, interleaved, after checking both give the same manifest):
  old   the former `merge_indexes` (pq.read_table per file, one after the other; duplicate keys found as a Python
        str per row), kept below verbatim as the baseline
  new   `merge_indexes`: `read_indexes` (pq.ParquetFile, INDEX_READERS files at a time), duplicates found in Arrow
and, of each, the time its reads alone take. Prints times and old / new. 2-core dev machine shared with other
jobs (load ~6-8: the figures swing), files in the page cache (tmpfs): 1M samples in 10,000 indexes, old 28.3 s
(reads 19.2 s), new 16.2 s (reads 10.9 s), 1.8x; 100k samples in 1,000: 1.61 s, 0.92 s, 1.7x. Linear in the
indexes either way; the rest of a merge (concat, the sort by key: ~4-5 s at 1M) is the same in both. On a node's
idle cores the reads spread further; on a shared file system each file's open and read are round trips, which
the readers overlap.

    python bench/commit_indexes.py --samples 1000000 --per-shard 100
"""

from __future__ import annotations

import argparse
import binascii
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one

from schemas.errors import UserError  # noqa: E402
from store import manifest  # noqa: E402
from store.manifest import TENSOR_STRUCT, FILE_STRUCT, WHERE_COLUMNS, _rank, empty_manifest  # noqa: E402


def old_merge_indexes(paths) -> pa.Table:
    """`merge_indexes` before `read_indexes` (store/manifest.py at 5cc143b), verbatim."""
    parts = [pq.read_table(p) for p in paths]
    if not parts:
        return empty_manifest()
    table = pa.concat_tables(parts, promote_options="permissive")
    table = table.sort_by([("key", "ascending"), ("shard", "ascending")])  # a rank's shards: by number (zero-padded)
    keys = table.column("key").to_pylist()
    again = [i for i in range(1, len(keys)) if keys[i] == keys[i - 1]]
    if not again:
        return table
    content = [c for c in table.column_names if c not in WHERE_COLUMNS]
    later = table.take(again).to_pylist()
    earlier = table.take([i - 1 for i in again]).to_pylist()
    for a, b in zip(earlier, later):
        if _rank(a["shard"]) != _rank(b["shard"]) or any(a[c] != b[c] for c in content):
            raise UserError("duplicate keys across shards")
    drop = set(again)
    return table.filter(pa.array([i not in drop for i in range(len(keys))], pa.bool_()))


def _lists(values: pa.Array | pa.ChunkedArray, counts: np.ndarray) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    return pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)), values)


def build(folder: Path, n: int, per_shard: int, seed: int = 0) -> list[Path]:
    """n rows written in random key order as index files of `per_shard` rows (8 ranks' shards)."""
    done = folder / "done"
    if done.is_file():
        return sorted(folder.glob("*.index.parquet"))
    folder.mkdir(parents=True, exist_ok=True)
    table = index_rows(n, per_shard, seed)
    names = table.column("shard").unique().to_pylist()
    for j, name in enumerate(names):
        pq.write_table(table.slice(j * per_shard, per_shard), folder / name.replace(".tar", ".index.parquet"))
    done.touch()
    return sorted(folder.glob("*.index.parquet"))


def index_rows(n: int, per_shard: int, seed: int = 0) -> pa.Table:
    """n manifest rows in random key order, `per_shard` rows a shard in order (8 ranks' shards)."""
    rng = np.random.default_rng(seed)
    raw = binascii.hexlify(rng.bytes(16 * n)).decode()
    keys = pa.array([raw[i * 32:(i + 1) * 32] for i in range(n)], pa.string())
    shard = np.arange(n) // per_shard
    ranks = 8
    names = np.array([f"shard-r{i % ranks:02d}-{i // ranks:06d}.tar" for i in range(shard.max() + 1)])
    side = rng.integers(4, 17, (n, 2)) * 8
    shapes = pa.array(np.repeat(np.stack([np.full(n, 16), np.ones(n, np.int64), side[:, 0], side[:, 1]], 1), 2,
                                axis=0).tolist(), pa.list_(pa.int64()))
    flat_offset = np.arange(2 * n) * 65536
    tensors = _lists(pa.StructArray.from_arrays(
        [pa.array(np.tile(["target", "control_0"], n)), pa.array(flat_offset), pa.array(np.full(2 * n, 65536)),
         pa.array(np.full(2 * n, "bfloat16")), shapes], fields=list(TENSOR_STRUCT)), np.full(n, 2))
    sha = np.array(["%064x" % i for i in range(n)])
    table = pa.table({
        "key": keys, "shard": pa.array(names[shard]), "shard_sha256": pa.array(np.full(n, "0" * 64)),
        "shard_nbytes": pa.array(np.full(n, per_shard * 131072, np.int64)),
        "sample_offset": pa.array((np.arange(n) % per_shard) * 131072),
        "sample_nbytes": pa.array(np.full(n, 131072, np.int64)), "sample_sha256": pa.array(sha),
        "tensors": tensors, "files": _lists(pa.array([], FILE_STRUCT), np.zeros(n, np.int64)),
        "shard_crc32c": pa.array(np.full(n, "00000000")), "sample_crc32c": pa.array(np.full(n, "0000abcd")),
        "split": pa.array(np.where(rng.random(n) < 0.05, "val", "train")),
        "img_shapes": _lists(pa.array(np.repeat(np.stack([np.ones(n, np.int64), side[:, 0] // 2, side[:, 1] // 2], 1),
                                                2, axis=0).tolist()), np.full(n, 2)),
        "num_controls": pa.array(np.ones(n, np.int64)), "has_mask": pa.array(np.zeros(n, bool)),
    })
    return table


def timed(fn, paths, read) -> tuple[float, float]:
    """(the whole call, its reads alone)."""
    t0 = time.perf_counter()
    read(paths)
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    fn(paths)
    return time.perf_counter() - t0, t_read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--per-shard", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm/commit-indexes"))
    a = ap.parse_args()
    t0 = time.perf_counter()
    paths = build(a.dir / f"n{a.samples}-{a.per_shard}", a.samples, a.per_shard)
    print(f"built/found {len(paths)} indexes in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    assert manifest.merge_indexes(paths).equals(old_merge_indexes(paths)), "the two merges disagree"
    runs = {"old": [], "new": []}
    for _ in range(a.repeat):  # interleaved: a busy machine slows both alike
        runs["old"].append(timed(old_merge_indexes, paths, lambda ps: [pq.read_table(p) for p in ps]))
        runs["new"].append(timed(manifest.merge_indexes, paths, manifest.read_indexes))
    (old, old_read), (new, new_read) = min(runs["old"]), min(runs["new"])
    print(json.dumps({"samples": a.samples, "indexes": len(paths), "old_s": round(old, 2),
                      "old_read_s": round(old_read, 2), "new_s": round(new, 2), "new_read_s": round(new_read, 2),
                      "old_over_new": round(old / new, 1)}))


if __name__ == "__main__":
    main()
