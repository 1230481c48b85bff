"""A commit's merge of the shard indexes into the manifest (`store.manifest.merge_measured`, rank 0 while every
other rank waits; also a URL's commit and `store repair`) over a real store of N samples (bench/scale_store.py
builds it): its memory and time, the former merge against the current one, each in a fresh process.

  old   the former `_merged` (kept below verbatim): the parts concatenated, `Table.sort_by` (the sort and the
        take over one chunk per index), the parts held until the end: two copies of the rows at the peak, plus
        each column's chunks joined for its take
  new   `_merged`: the order from the key and shard columns joined, then one column at a time joined, taken and
        dropped from the parts: ~one copy of the rows
For each table's v1, each side --repeat times, interleaved; checks both give the same manifest bytes (sha256 of
its parquet). Prints per side the growth of the process's peak RSS (VmHWM, from the reads' end), Arrow's peak
allocation in the merge, and its seconds; then old / new.

    python bench/merge_memory.py --samples 30000 100000 300000 --dir /tmp/scale

2-core machine shared with other helpers (load ~6: times swing, memory is steady), ext4, page cache warm, best
of 2 (the RSS has ~70-80 MB that do not grow with N: the readers' threads, first reads):
  N=30k   vae     116 indexes  old 0.70 s +111 MB RSS  35 MB Arrow   new 0.37 s +113 MB RSS  32 MB Arrow
          images  177 indexes  old 1.25 s +138 MB RSS  46 MB Arrow   new 0.50 s +140 MB RSS  42 MB Arrow
  N=100k  vae     384 indexes  old 1.35 s +203 MB RSS 117 MB Arrow   new 0.87 s +175 MB RSS  75 MB Arrow
          images  590 indexes  old 4.37 s +296 MB RSS 153 MB Arrow   new 2.16 s +220 MB RSS  91 MB Arrow
  N=300k  vae    1152 indexes  old 2.14 s +523 MB RSS 352 MB Arrow   new 1.71 s +339 MB RSS 225 MB Arrow
          images 1769 indexes  old 5.59 s +722 MB RSS 459 MB Arrow   new 5.78 s +452 MB RSS 264 MB Arrow
At 1M (linear from 100k-300k): vae ~+1.65 GB -> ~+1.0 GB, images ~+2.2 GB -> ~+1.3 GB. Times swing ~2x with load.
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


def _status(name: str) -> int:
    """A /proc/self/status figure in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) // 1024
    return 0


def old_merge_measured(paths: list[Path]) -> pa.Table:
    """The former `merge_measured` (at e98f9b5): every index read and held, then `old_merged`."""
    reads = manifest.read_indexes(paths)
    return old_merged([r.rows for r in reads])


def child(vdir: Path, side: str) -> None:
    """One merge in this fresh process, the indexes listed (as the commit does) and the peak RSS reset first.
    Prints a JSON line."""
    from store.writer_open import index_paths

    paths = index_paths(vdir)
    rss = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    table = old_merge_measured(paths) if side == "old" else manifest.merge_measured(paths)[0]
    seconds = time.perf_counter() - t0
    peak_rss = _status("VmHWM") - rss
    print(json.dumps({"indexes": len(paths), "rows": table.num_rows, "s": seconds, "rss_mb": peak_rss,
                      "arrow_mb": pa.default_memory_pool().max_memory() / 2**20,
                      "sha": hashlib.sha256(fmt.parquet_bytes(table)).hexdigest()}))


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
