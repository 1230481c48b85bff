"""The commit's merge of many quarantine rows at once (`store/quarantine.py` `merged_rows`): resize-bucket's rejects
of a bad batch (a ~60-char path, its decoder's ~120-char detail, the `pictures` identity), every one appended by one
commit, each stage's append going through the same merge.

Two cases, each way in a fresh process (the inputs read from Arrow IPC files written here), interleaved --repeat
times, the least time and memory of each kept:
  fresh   --new rows into an empty file
  rerun   the same --new rows into a file of --existing rows of the same source, half of the new ones among them
          (a run killed after its commit, rerun)
  old     the former `_first_unseen` (a group_by over every compared column of the file's candidates and the new
          rows together, concatenated), kept below verbatim as the baseline, and the former `take` of every row kept
  new     `quarantine.merged_rows`: each column's dense ranks folded into one int64 code a row
Figures: seconds; Arrow's peak over what it held before (the pool's max_memory), Python's (tracemalloc) and the RSS
peak (VmHWM) over the RSS before; old / new. Both ways' files (`to_bytes`) are checked to hold the same seal and the
same rows in the same order (their pages may split at other rows: the new way hands the rows on in their chunks).

    PYTHONPATH=. python bench/quarantine_merge.py                       # ~30 s: --new 200000 --existing 200000
    PYTHONPATH=. python bench/quarantine_merge.py --new 1000000 --existing 1000000 --repeat 1

2-core machine shared with 5 other jobs (times swing; memory is the steadier figure), RSS peak over the start:
  case    rows            old                        new                       old/new
  fresh   200k            0.24 s, +241 MB (1.2 KB)   0.17 s, +38 MB (191 B)    time 1.4x, RSS peak 6.3x
  rerun   200k into 200k  0.34 s, +358 MB            0.34 s, +93 MB            time 1.0x, RSS peak 3.9x
  fresh   1M (repeat 1)   1.53 s, +1128 MB           1.82 s, +131 MB           time 0.8x, RSS peak 8.6x
  rerun   1M into 1M      2.90 s, +1317 MB           1.89 s, +361 MB           time 1.5x, RSS peak 3.7x
  (rerun's new peak: ~160 MB of it the 500k rows added, taken out of the new ones, as before; the rest the key's
  hash table and one column of the old rows that share a key with a new one at a time)
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one

CHILD = r"""
import hashlib, json, sys, time, tracemalloc
from pathlib import Path
import pyarrow as pa
sys.path.insert(0, "bench")
from store import quarantine
from quarantine_merge import old_merged_rows

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

def load(path):
    with pa.OSFile(str(path)) as f:
        return pa.ipc.open_file(f).read_all()

folder, way = Path(sys.argv[1]), sys.argv[2]
rows = load(folder / "new.arrow")
old = load(folder / "old.arrow") if (folder / "old.arrow").is_file() else None
merge = old_merged_rows if way == "old" else quarantine.merged_rows
pool = pa.default_memory_pool()
held, peak_before, before = pa.total_allocated_bytes(), pool.max_memory(), rss()  # the read's peak: see unsure
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
tracemalloc.start()
t0 = time.perf_counter()
merged, added = merge(old, rows)
seconds = time.perf_counter() - t0
py_peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
rss_peak, arrow_peak = hwm() - before, pool.max_memory() - held
unsure = pool.max_memory() == peak_before  # the merge's peak below the inputs' read's: Arrow's figure an upper bound
import pyarrow.parquet as pq
data = quarantine.to_bytes(merged)  # its seal, then its rows as read back (the pages may split at other rows)
meta = pq.ParquetFile(pa.BufferReader(data)).schema_arrow.metadata
sink = pa.BufferOutputStream()
with pa.ipc.new_stream(sink, merged.schema) as w:
    w.write_table(quarantine.parsed(data)[0].combine_chunks().replace_schema_metadata(merged.schema.metadata))
digest = hashlib.sha256(repr(sorted(meta.items())).encode() + sink.getvalue().to_pybytes()).hexdigest()
print(json.dumps({"seconds": seconds, "arrow_mb": arrow_peak / 1e6, "py_mb": py_peak / 1e6, "peak_mb": rss_peak / 1e6,
                  "added": added, "digest": digest, "unsure": unsure}))
"""


def old_merged_rows(old: pa.Table | None, rows: pa.Table) -> tuple[pa.Table, int]:
    """`merged_rows` with the former `_first_unseen` (store/quarantine.py at c66daf29) and its `take` of the rows
    kept even when every row is."""
    from store.quarantine import DERIVED

    if old is None or not old.num_rows:
        old = None
    identity = [c for c in rows.column_names if c != "time" and c not in DERIVED]
    if not identity:
        keep = np.arange(min(rows.num_rows, 1 if old is None else 0))
    else:
        keep = old_first_unseen(old, rows, identity)
    if not len(keep):
        return (old if old is not None else rows.slice(0, 0)), 0
    fresh = rows.take(pa.array(keep, pa.int64()))
    return (fresh if old is None else pa.concat_tables([old, fresh], promote_options="permissive")), len(keep)


def old_first_unseen(old: pa.Table | None, rows: pa.Table, identity: list[str]) -> np.ndarray:
    """The former rule (store/quarantine.py at c66daf29), verbatim."""
    n = rows.num_rows

    def col(t: pa.Table, c: str) -> pa.Array:
        a = t.column(c).combine_chunks() if c in t.column_names else pa.nulls(t.num_rows)
        return a.cast(pa.string())

    if old is not None:
        first = col(rows, identity[0])
        old = old.filter(pc.is_in(col(old, identity[0]), value_set=first.unique()))
    m = 0 if old is None else old.num_rows
    both = {f"c{i}": pa.concat_arrays(([col(old, c)] if m else []) + [col(rows, c)]) for i, c in enumerate(identity)}
    both["row"] = pa.array(np.arange(m + n))
    firsts = pa.table(both).group_by(list(both)[:-1], use_threads=False).aggregate([("row", "min")])
    firsts = firsts.column("row_min").to_numpy()
    return np.sort(firsts[firsts >= m]) - m


def bad_batch(first: int, n: int) -> pa.Table:
    """Rows `first` .. `first + n - 1` of a bad batch, as resize-bucket rejects them (`RejectRows.table()`: the base
    columns but `time`, then `pictures`; in chunks of 4096 rows, as it holds them)."""
    i = np.arange(first, first + n)
    path = np.char.add(np.char.add(np.char.add("/data/edits/batch_", (i // 10000).astype(str)), "/target/pair_"),
                       np.char.add(np.char.mod("%07d", i), ".png"))
    key = np.array([hashlib.sha256(str(k).encode()).hexdigest()[:32] for k in i.tolist()])
    cols = {"key": key, "source": path, "stage": np.full(n, "resize-bucket"), "reason": np.full(n, "unreadable-image"),
            "detail": np.char.add(np.char.add("target (", path),
                                  "): not a readable image (formats accepted: PNG, JPEG, WEBP, TIFF, BMP, GIF)"),
            "time": np.full(n, "2026-01-01T00:00:00+00:00"), "pictures": np.char.add("t:", key)}
    table = pa.table({c: pa.array(v.tolist(), pa.string()) for c, v in cols.items()})
    return pa.Table.from_batches(table.to_batches(max_chunksize=4096))


def write(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)


def main() -> None:
    from old_vs_new import best_interleaved, child_json  # bench/

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=200_000)
    ap.add_argument("--existing", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    least = ("seconds", "arrow_mb", "py_mb", "peak_mb")
    with tempfile.TemporaryDirectory(prefix="quarantine_merge_") as tmp:
        for case in ("fresh", "rerun"):
            folder = Path(tmp) / case
            folder.mkdir()
            write(folder / "new.arrow", bad_batch(0, a.new))
            if case == "rerun":  # the file: rows of the source before the new ones, then half of the new ones
                write(folder / "old.arrow", bad_batch(a.new // 2 - a.existing, a.existing))
            old, new = best_interleaved(a.repeat, lambda way: child_json(CHILD, str(folder), way), least)
            if (old["digest"], old["added"]) != (new["digest"], new["added"]):
                raise SystemExit(f"{case}: old and new merge different rows")
            report(case, a, old, new)


def report(case: str, a: argparse.Namespace, old: dict, new: dict) -> None:
    print(f"{case:5s} {a.new:,} new rows" + (f" into {a.existing:,}" if case == "rerun" else "") +
          f", {new['added']:,} added" + (" (an Arrow peak is at most: the inputs' read peaked higher)"
                                         if old["unsure"] or new["unsure"] else ""))
    for way, r in (("old", old), ("new", new)):
        print(f"  {way}: {r['seconds']:.2f} s, Arrow +{r['arrow_mb']:.0f} MB, Python +{r['py_mb']:.0f} MB, "
              f"RSS peak +{r['peak_mb']:.0f} MB ({r['peak_mb'] * 1e6 / a.new:.0f} B a new row)")
    print(f"  old/new: time {old['seconds'] / new['seconds']:.1f}x, Arrow peak "
          f"{old['arrow_mb'] / max(new['arrow_mb'], 1):.1f}x, RSS peak {old['peak_mb'] / max(new['peak_mb'], 1):.1f}x",
          flush=True)

if __name__ == "__main__":
    main()
