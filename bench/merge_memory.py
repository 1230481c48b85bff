"""A commit's merge of the shard indexes into the manifest, and the manifest written (`store.manifest.merge_runs`
+ `MergedIndexes.write`, rank 0 while every other rank waits; also a URL's commit) over a real store of N samples
(bench/scale_store.py builds it): its memory and time, the former merge against the current one, each in a fresh
process.

  old   the former commit (store/manifest.py at daf0fa4, kept below verbatim): the indexes joined 256 at a time,
        then sorted one column at a time into one table (~one copy of the rows decoded), then `fmt.parquet_bytes`
        (the file's bytes in memory too) written to the file
  new   `merge_runs`: the rows sorted 131k at a time into runs held as parquet bytes (~1/5 of their Arrow size),
        only the key and shard columns decoded; then `write` streams the manifest row group by row group
For each table's v1, each side --repeat times, interleaved; checks both write the same manifest bytes (sha256 of
the file). Prints per side the growth of the process's peak RSS (VmHWM, from the reads' end), Arrow's peak
allocation, and its seconds; then old / new.

    python bench/merge_memory.py --samples 100000 300000 --dir /tmp/scale

2-core machine shared with other helpers (load 2-4), ext4, page cache warm, best of 2 (the RSS has ~70-80 MB that
do not grow with N: the readers' threads, first reads):
  N=100k  images  590 indexes  old 4.92 s +190 MB RSS  91 MB Arrow   new 3.68 s +187 MB RSS  84 MB Arrow
          vae     384 indexes  old 1.51 s +149 MB RSS  75 MB Arrow   new 2.57 s +149 MB RSS  67 MB Arrow
  N=300k  images 1769 indexes  old 22.1 s +427 MB RSS 264 MB Arrow   new 9.61 s +299 MB RSS 120 MB Arrow
          vae    1152 indexes  old 4.14 s +326 MB RSS 225 MB Arrow   new 5.78 s +255 MB RSS  99 MB Arrow
At 1M (linear from 100k-300k): images ~+1.25 GB -> ~+0.69 GB RSS (Arrow ~0.87 GB -> ~0.25 GB), vae ~+0.94 GB ->
~+0.63 GB. Most of the new peak does not grow with N (~2 runs being sorted, one row group being written, the
allocator's retained pages); what does is the runs' bytes (~17 MB per 100k rows) and the keys (~5 MB). Times
swing ~2x with load (the new merge encodes and decodes each row once more: ~1.4x the old at low load).

The former merge before daf0fa4 (`old_merged` below, the reference the tests compare with) held two copies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from schemas import atomic_write  # noqa: E402
from schemas.errors import UserError  # noqa: E402
from store import format as fmt  # noqa: E402
from store import manifest  # noqa: E402
from store.manifest import WHERE_COLUMNS, _rank, empty_manifest  # noqa: E402


def old_merged(parts: list[pa.Table]) -> pa.Table:
    """`_merged` before it sorted one column at a time (store/manifest.py at e98f9b5), verbatim."""
    if not parts:
        return empty_manifest()
    table = pa.concat_tables(parts, promote_options="permissive")
    table = table.sort_by([("key", "ascending"), ("shard", "ascending")])  # a rank's shards: by number (zero-padded)
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
            raise UserError("duplicate keys across shards")
    keep = np.ones(len(keys), bool)
    keep[again] = False
    return table.filter(pa.array(keep))


# ---------------------------------------------------------------- the former commit (store/manifest.py at daf0fa4)


def joined_merge_measured(paths: list[Path]) -> pa.Table:
    """`merge_measured` at daf0fa4, verbatim but for the checksums it returned."""
    parts = []
    for i in range(0, len(paths), 256):
        batch = paths[i:i + 256]
        reads = manifest.read_indexes(batch)
        parts.append(pa.concat_tables([r.rows for r in reads], promote_options="permissive").combine_chunks())
        del reads
    return joined_merged(parts)


def joined_merged(parts: list[pa.Table]) -> pa.Table:
    """`_merged` at daf0fa4, verbatim."""
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
    again = np.flatnonzero(pc.equal(keys.slice(1), keys.slice(0, len(keys) - 1)).to_numpy(zero_copy_only=False)) + 1 \
        if len(keys) > 1 else np.zeros(0, np.int64)
    if not len(again):
        return table
    content = [c for c in table.column_names if c not in WHERE_COLUMNS]
    later = table.take(pa.array(again)).to_pylist()
    earlier = table.take(pa.array(again - 1)).to_pylist()
    for a, b in zip(earlier, later):
        if _rank(a["shard"]) != _rank(b["shard"]) or any(a[c] != b[c] for c in content):
            raise UserError("duplicate keys across shards")
    keep = np.ones(len(keys), bool)
    keep[again] = False
    return table.filter(pa.array(keep))


def _status(name: str) -> int:
    """A /proc/self/status figure in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) // 1024
    return 0


def child(vdir: Path, side: str) -> None:
    """One merge and its manifest written (to a temp file) in this fresh process, the indexes listed (as the commit
    does) and the peak RSS reset first. Prints a JSON line."""
    import tempfile

    from store.writer_open import index_paths

    paths = index_paths(vdir)
    import pandas  # noqa: F401  # pyarrow's parquet writer imports it on first use: ~80 MB that do not grow with N
    rss = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / fmt.MANIFEST
        t0 = time.perf_counter()
        if side == "old":
            table = joined_merge_measured(paths)
            rows = table.num_rows
            fmt.atomic_write_bytes(out, fmt.parquet_bytes(table))
        else:
            merged = manifest.merge_runs(paths)
            rows = merged.num_rows
            with atomic_write.atomic_file(out) as f:
                merged.write(f)
        seconds = time.perf_counter() - t0
        peak_rss = _status("VmHWM") - rss
        sha = hashlib.sha256(out.read_bytes()).hexdigest()
    print(json.dumps({"indexes": len(paths), "rows": rows, "s": seconds, "rss_mb": peak_rss,
                      "arrow_mb": pa.default_memory_pool().max_memory() / 2**20, "sha": sha}))


def measure(vdir: Path, side: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(vdir), side], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[100_000])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/scale"))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--tables", default="images,vae")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(Path(args.child[0]), args.child[1])
    from scale_store import build

    for n in args.samples:
        root = build(args.dir, n)
        for table in args.tables.split(","):
            runs: dict[str, list[dict]] = {"old": [], "new": []}
            for _ in range(args.repeat):  # interleaved: a busy machine slows both alike
                for side in runs:
                    runs[side].append(measure(root / table / "v1", side))
            assert len({r["sha"] for rs in runs.values() for r in rs}) == 1, f"{table}: the manifests differ"
            best = {side: {k: min(r[k] for r in rs) for k in ("s", "rss_mb", "arrow_mb")} for side, rs in runs.items()}
            o, w = best["old"], best["new"]
            print(f"N={n} {table}: {runs['old'][0]['indexes']} indexes; old {o['s']:.2f} s, +{o['rss_mb']} MB RSS, "
                  f"{o['arrow_mb']:.0f} MB Arrow; new {w['s']:.2f} s, +{w['rss_mb']} MB RSS, {w['arrow_mb']:.0f} MB "
                  f"Arrow; old / new: {o['s'] / w['s']:.2f}x time, {o['rss_mb'] / max(w['rss_mb'], 1):.2f}x RSS, "
                  f"{o['arrow_mb'] / max(w['arrow_mb'], 1):.2f}x Arrow", flush=True)


if __name__ == "__main__":
    main()
