"""An encode rank's search for stored rows it can carry forward (store/reuse.py `reusable`), which every rank of an
encode rerun runs on its share of the keys before its first batch (a rerun after any `images` change: samples
added, a val split relabelled), and resize-bucket's rank 0 on every key.
Before, each rank parsed every column of the whole `text` / `vae` manifest (~500 MB at 1M samples) and filtered it
down to its share (1/64 of it on 8 nodes x 8 ranks); now the share's rows are found in the key column the reader
holds and read a manifest row group at a time (`ManifestView.table_at`).
Over stores from bench/scale_store.py (--dir, one per --samples: `n<N>`, v1 of each table), for rank 0 of
--world-size (its share: `TableReader.iter_keys` of `images`, as encode's), each way in a fresh process, old and
new interleaved --repeat times (best kept), after checking both find the same rows: the peak of
Arrow's allocations over the search, and seconds.

    PYTHONPATH=. python bench/reuse_rows.py --samples 30000 100000 --dir /tmp/scale [--world-size 64] [--table vae]

2-core machine shared with other jobs (load 4-7), rank 0 of 64, best of 2; the peak is Arrow's allocations over
the search (pool max_memory: every decoded manifest column; file pages not counted), the manifest in row groups of
64k rows (fmt.ROW_GROUP_ROWS):
  N=30k   text  old +31 MB 0.87 s    new +25 MB 0.07 s
  N=100k  text  old +53 MB 0.53 s    new +50 MB 0.22 s    (below two row groups both decode about the same)
  N=300k  text  old +157 MB 2.52 s   new +60 MB 0.47 s
  N=300k  vae   old +182 MB 3.19 s   new +68 MB 0.53 s
  1M (linear in N; new bounded by a row group): old ~+500-600 MB and ~8-10 s per rank (4-5 GB per 8-rank node),
  new ~+70 MB
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

CHILD = r"""
import gc, json, sys, time
import pyarrow as pa
import pyarrow.compute as pc
from store import Store
from store import reuse

def old_reusable(store, table, lineage, keys):
    # the former search (store/reuse.py before bench/reuse_rows.py), without the damage branches: every column of
    # the whole manifest parsed, then filtered to the wanted keys
    from store.reader import TableReader
    wanted = pa.array(sorted(set(keys)), pa.string())
    found = {}
    for v in reversed(store.versions(table)):
        reader = TableReader(store.version_dir(table, v), table, v, on_damaged="skip")
        if not reuse.same_features(reader.schema.attrs, {lineage}):
            reader.close()
            continue
        manifest = reader.manifest
        keep = pc.is_in(manifest.column("key"), value_set=wanted)
        reader.close()
        rows = manifest.filter(keep)
        if rows.num_rows:
            found[v] = rows
            wanted = wanted.filter(pc.invert(pc.is_in(wanted, value_set=rows.column("key"))))
    return found

root, table, keys_file, way = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
share = json.loads(open(keys_file).read())
st = Store(root, create=False)
r = st.reader(table, 1)
lineage = r.schema.attrs[reuse.FEATURE_LINEAGE_ATTR]
r.close()
gc.collect()
pool = pa.default_memory_pool()
base = pool.bytes_allocated()
t0 = time.perf_counter()
found = (old_reusable if way == "old" else reuse.reusable)(st, table, lineage, share)
seconds = time.perf_counter() - t0
peak = pool.max_memory() - base  # Arrow's allocations: every decoded manifest column (file pages not counted)
rows = pa.concat_tables([t.combine_chunks() for t in found.values()]) if found else None
digest = __import__("hashlib").sha256(repr(rows.to_pydict() if rows is not None else None).encode()).hexdigest()
print(json.dumps({"peak_mb": max(peak, 0) / 1e6, "seconds": seconds, "share": len(share),
                  "rows": 0 if rows is None else rows.num_rows, "digest": digest}))
"""


SHARE = r"""
import json, sys
from store import Store
img = Store(sys.argv[1], create=False).reader("images", 1)
print(json.dumps(img.iter_keys(rank=0, world_size=int(sys.argv[2]))))
"""


def share_file(store: Path, world: int, into: Path) -> Path:
    """Rank 0's share of the keys (encode's: `iter_keys` of `images`), worked out once, in a process of its own."""
    from old_vs_new import child_json  # bench/

    into.write_text(json.dumps(child_json(SHARE, str(store), str(world))))
    return into


def main() -> None:
    from old_vs_new import best_interleaved, child_json  # bench/

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[30_000, 100_000])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/scale"))
    ap.add_argument("--table", default="text", choices=["text", "vae", "images"])
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for n in args.samples:
        store = args.dir / f"n{n}"
        with tempfile.TemporaryDirectory() as tmp:
            keys = share_file(store, args.world_size, Path(tmp) / "share.json")
            old, new = best_interleaved(args.repeat,
                                        lambda way: child_json(CHILD, str(store), args.table, str(keys), way))
        if old["digest"] != new["digest"]:
            raise SystemExit(f"N={n}: old and new found different rows ({old['rows']} vs {new['rows']})")
        print(f"N={n:>9,} {args.table} rank 0 of {args.world_size} ({new['share']:,} keys, {new['rows']:,} rows "
              f"found): old +{old['peak_mb']:.0f} MB {old['seconds']:.2f} s   new +{new['peak_mb']:.0f} MB "
              f"{new['seconds']:.2f} s   memory old/new {old['peak_mb'] / max(new['peak_mb'], 1):.1f}x", flush=True)


if __name__ == "__main__":
    main()
