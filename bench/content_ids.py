"""The content identity of a joined `text` + `vae` split at scale (`JoinedTables.content_ids`, store/join.py): what a
resume or `run all`'s up-to-date check hashes when the version ids differ, and rank 0 once per training start.

Builds `--rows` synthetic manifest rows per table (32-hex keys, sha256 / CRC32C hex, img_shapes of a target and a
control, text lengths), parses them the way a reader's view does, and measures in the same run:
  baseline  `Store.version_id` of both versions: sha256 of their manifest bytes (what `versions()` already costs)
  content   `content_ids()` of the join (its columns parsed from the manifest bytes, hashed a chunk at a time)
Prints each time (best of --repeat) and content / baseline. 1M rows in `fmt.ROW_GROUP_ROWS` (65,536-row) groups as
the store writes them (text 100 MB, vae 104 MB), 2-core dev machine at load ~4, three runs: 0.13-0.18 s,
0.95-1.03 s, 5.4-7.2x (one-row-group manifests had given 0.17 s, 1.26 s, 7.3x).

    python bench/content_ids.py --rows 1000000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "store")]  # this checkout's store/, not an installed one

from store import format as fmt  # noqa: E402
from store_samples import joined_over_manifests  # noqa: E402  (the join the tests build, no store behind it)


def manifest(n: int, table: str, rng: np.random.Generator) -> bytes:
    """A manifest's bytes with the columns `content_ids` and the join read (setup: Python lists are fine here)."""
    keys = np.sort(rng.integers(0, 2**63, n, dtype=np.int64))
    sha = rng.bytes(n * 32)
    cols = {
        "key": pa.array([f"{int(k):032x}" for k in keys]),
        "shard": pa.array([f"shard-r00-{i // 1000:06d}.tar" for i in range(n)]),
        "sample_offset": pa.array(np.arange(n, dtype=np.int64) * 4096),
        "sample_nbytes": pa.array(np.full(n, 4096, np.int64)),
        "sample_sha256": pa.array([sha[i * 32:(i + 1) * 32].hex() for i in range(n)]),
        "sample_crc32c": pa.array([f"{int(v):08x}" for v in rng.integers(0, 2**32, n, dtype=np.int64)]),
        "split": pa.array(np.where(rng.random(n) < 0.9, "train", "val")),
    }
    if table == "vae":
        cols["img_shapes"] = pa.array([[[1, int(a), int(a)], [1, int(b), int(b)]] for a, b in rng.integers(4, 64, (n, 2))])
    else:
        cols["length"] = pa.array(rng.integers(8, 512, n))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(cols), sink, row_group_size=fmt.ROW_GROUP_ROWS)  # grouped as the store writes them
    return sink.getvalue().to_pybytes()


def best(fn, repeat: int, setup=lambda: None) -> float:
    times = []
    for _ in range(repeat):
        arg = setup()
        t = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    data = {t: manifest(args.rows, t, rng) for t in ("text", "vae")}
    print(f"{args.rows} rows: manifests of {', '.join(f'{t} {len(b) / 1e6:.0f} MB' for t, b in data.items())}")
    baseline = best(lambda _: [fmt.version_id(1, b) for b in data.values()], args.repeat)
    content = best(lambda j: j.content_ids(), args.repeat, setup=lambda: joined_over_manifests(data))
    print(f"baseline (version ids)  {baseline:.3f} s")
    print(f"content ids             {content:.3f} s   (every content column parsed from the manifest bytes)")
    print(f"content / baseline      {content / baseline:.1f}x")


if __name__ == "__main__":
    main()
