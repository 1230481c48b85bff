"""STORE/quarantine.parquet as every rank reads it at its start: train's and evaluate's dropped report (key, stage,
reason) and encode's left-out samples (key, reason, table_version) on each of 8 nodes x 8 ranks. The file holds
every stage's rejects of every version (bench/quarantine_append.py's rows: ~1M at 1M samples), with their
`source` and `detail` texts. Before, each rank parsed the whole file; now only the columns it compares
(`quarantine.read(root, columns)`).
For each --rows, a file of that many rows (bench/quarantine_append.py `rows`, 8 versions) in --dir (reused), then
each read in a fresh process, old and new interleaved --repeat times (best kept), after checking both give the same
values: seconds, the parsed table's bytes and the peak RSS over the process's RSS before the read (VmHWM).

    PYTHONPATH=. python bench/quarantine_columns.py --rows 100000 300000 1000000

2-core machine shared with other jobs (load 4-7: the times swing widely; the memory is the steadier figure), best of 3:
  rows   file    old: parsed, peak, s          new: parsed, peak, s      (dropped report; encode's read alike)
  100k   2 MB    20 MB, +66 MB, 0.04 s         7 MB, +40 MB, 0.02 s
  300k   14 MB   60 MB, +129 MB, 1.16 s        20 MB, +63 MB, 0.06 s
  1M     45 MB   199 MB, +347 MB, 2.40 s       68 MB, +143 MB, 0.20 s    x 64 ranks: ~22 GB -> ~9 GB of peaks
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from store import format as fmt  # noqa: E402
from store import quarantine  # noqa: E402

READS = {"report": ["key", "stage", "reason"], "encode": ["key", "reason", "table_version"]}

CHILD = r"""
import hashlib, json, sys, time
import psutil
from pathlib import Path
from store import quarantine
root, way, columns = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
import pyarrow.dataset, pyarrow.parquet  # their imports (read_table imports the dataset module): in neither read
before = psutil.Process().memory_info().rss
t0 = time.perf_counter()
q = quarantine.read(root) if way == "old" else quarantine.read(root, columns)  # old: the whole file, as before
seconds = time.perf_counter() - t0
peak = hwm() - before
digest = hashlib.sha256(repr(q.select(columns).to_pydict()).encode()).hexdigest()
print(json.dumps({"seconds": seconds, "table_mb": q.nbytes / 1e6, "peak_mb": max(peak, 0) / 1e6, "digest": digest}))
"""


def main() -> None:
    from old_vs_new import best_interleaved, child_json  # bench/
    from quarantine_append import rows  # bench/: the rows its append bench builds

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[100_000, 300_000])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/quarantine-columns"))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for n in args.rows:
        root = args.dir / f"q{n}"
        root.mkdir(parents=True, exist_ok=True)
        if not (root / fmt.QUARANTINE).is_file():
            fmt.atomic_write_bytes(root / fmt.QUARANTINE, quarantine.to_bytes(rows(n, 8, 1, np.random.default_rng(0))))
        mb = (root / fmt.QUARANTINE).stat().st_size / 1e6
        for what, columns in READS.items():
            old, new = best_interleaved(args.repeat, lambda way: child_json(CHILD, str(root), way, json.dumps(columns)))
            if old["digest"] != new["digest"]:
                raise SystemExit(f"{n} rows, {what}: old and new read different values")
            print(f"{n:>9,} rows ({mb:.0f} MB file) {what:6s}: old {old['seconds']:.2f} s, {old['table_mb']:.0f} MB "
                  f"parsed, peak +{old['peak_mb']:.0f} MB   new {new['seconds']:.2f} s, {new['table_mb']:.0f} MB, "
                  f"peak +{new['peak_mb']:.0f} MB   old/new: time {old['seconds'] / max(new['seconds'], 1e-3):.1f}x, "
                  f"peak {old['peak_mb'] / max(new['peak_mb'], 1):.1f}x", flush=True)


if __name__ == "__main__":
    main()
