"""The counts closing a resize-bucket run that carried or resumed samples (stages/resize/summary.py `version_counts`:
the new `images` version's samples by split, by number of controls and by target bucket), on rank 0 while every
other rank waits; after a val_fraction change or samples added, at 1M samples.
Before, a reader of the version was opened (every shard stat'ed) and its whole manifest parsed (every column,
~730 MB at 1M samples), then each of the three columns turned into a Python object per row; now the three columns
are read from the checked manifest and counted in Arrow.
Over stores from bench/scale_store.py (--dir, one per --samples: `n<N>`, `images` v1), each way in a fresh process,
old and new interleaved --repeat times (best kept), after checking both count alike: the peak RSS over the
process's RSS before (VmHWM: the manifest's file pages are counted alike in both) and seconds.

    PYTHONPATH=. python bench/resize_counts.py --samples 30000 100000 300000 --dir /tmp/scale

2-core machine shared with other jobs (load 4-7), images v1 of bench/scale_store.py stores, best of 2:
  N=30k    old +125 MB 0.99 s   new +66 MB 0.43 s
  N=100k   old +224 MB 1.74 s   new +81 MB 0.76 s
  N=300k   old +474 MB 4.34 s   new +122 MB 0.51 s
  1M (linear from 100k-300k): old ~+1.35 GB, ~10 s; new ~+260 MB (mostly the manifest's mapped pages), ~1 s
"""

from __future__ import annotations

import argparse
from pathlib import Path

CHILD = r"""
import gc, json, sys, time
from collections import Counter
import psutil
from store import Store
from stages.resize.summary import version_counts

def old_counts(st, version):
    # the former counting (stages/resize/stage.py before bench/resize_counts.py), verbatim
    with st.reader("images", version) as r:
        splits = Counter(r.manifest.column("split").to_pylist())
        controls = Counter(r.manifest.column("num_controls").to_pylist())
        buckets = Counter(map(tuple, r.manifest.column("bucket").to_pylist()))
    return splits, controls, buckets

st = Store(sys.argv[1], create=False)
gc.collect()
before = psutil.Process().memory_info().rss
t0 = time.perf_counter()
splits, controls, buckets = (old_counts if sys.argv[2] == "old" else version_counts)(st, 1)
seconds = time.perf_counter() - t0
peak = hwm() - before
print(json.dumps({"peak_mb": max(peak, 0) / 1e6, "seconds": seconds,
                  "counts": [sorted(splits.items()), sorted(controls.items()), sorted(buckets.items())]}))
"""


def main() -> None:
    from old_vs_new import best_interleaved, child_json  # bench/

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[30_000, 100_000])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/scale"))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for n in args.samples:
        old, new = best_interleaved(args.repeat, lambda way: child_json(CHILD, str(args.dir / f"n{n}"), way))
        if old["counts"] != new["counts"]:
            raise SystemExit(f"N={n}: old and new count differently: {old['counts']} vs {new['counts']}")
        print(f"N={n:>9,}: old +{old['peak_mb']:.0f} MB {old['seconds']:.2f} s   new +{new['peak_mb']:.0f} MB "
              f"{new['seconds']:.2f} s   old/new: memory {old['peak_mb'] / max(new['peak_mb'], 1):.1f}x, time "
              f"{old['seconds'] / max(new['seconds'], 1e-3):.1f}x", flush=True)


if __name__ == "__main__":
    main()
