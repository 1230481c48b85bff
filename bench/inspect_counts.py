"""`pipeline store inspect` at scale (store/inspect.py `describe`): each complete version's samples, shards, bytes,
splits and buckets.

--synthetic N --versions V: recorded counts against counted columns. Builds (once, under --dir) V versions of an
`images` table of N rows each - manifest.parquet with the real column set (key, shard, sizes, CRCs, a files list of
1-3 members, split, bucket, control_sizes, img_shapes, caption, source), no shard files (inspect reads none) -
twice: `recorded/` as committed now (checksums.json holds `counts`, `store.version_counts`) and `columns/` as
committed before (the same manifests, hard-linked; checksums.json without `counts`). Then `describe` of each
store, --repeat times in fresh processes, interleaved (after checking both describe alike): time (best), peak RSS
over the RSS after imports and Arrow's peak allocation (max). 2-core shared machine (load ~6), warm page cache,
1M rows x 3 versions (manifest 140 MB, 20k shards, checksums.json 1.8 MB each), --repeat 3, two runs:
  columns   5.89-11.38 s, peak RSS +483-491 MB, Arrow peak 171 MB
  recorded  0.52-0.93 s, peak RSS +143 MB (one manifest's mapped pages: page cache, checked by CRC32C), Arrow 0
  11.3x-12.2x in the same run. In process, warm: recorded 0.27 s (0.36-0.45 s while checksums.json was parsed
  twice per version, for the schema's check and for the counts), ~0.04 s of it the manifests' CRC32C.

Without --synthetic: over a store from bench/scale_store.py, measures in the same run (best of --repeat,
interleaved, after checking both describe the store alike):
  old   the former counting (kept below verbatim): the whole manifest read (every column, the nested tensor and
        file lists too), every counted column turned into Python objects row by row
  new   `describe`: the counted columns alone, counted in Arrow / numpy
2-core shared machine (load ~5), files in the page cache, images + text + vae of 100k samples each: old 1.0 s,
new 0.07 s, 15x; 300k: old 4.3 s, new 0.26 s, 17x. A cold `store inspect` of 300k samples took 33 s (load ~7).

    python bench/inspect_counts.py /tmp/scale/n100000 [--repeat 3]
    python bench/inspect_counts.py --synthetic 1000000 --versions 3 [--dir /tmp/inspect-counts] [--repeat 3]
    python bench/inspect_counts.py --synthetic 1000000 --versions 2 --url [--dir ...] [--repeat 2]

--url (1M rows x 2 versions as file:// URLs, same machine, two runs): without counts 283.2 MB read (both manifests,
fetched as every version's was before), 2.0-2.4 s with their columns counted; recorded 3.6 MB read (checksums.json
1.8 MB + schema.json per version: the manifests left at the URL), 0.06 s. Over S3 the 280 MB are the wait.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's store/, not an installed one

from store import format as fmt  # noqa: E402
from store import inspect  # noqa: E402
from store.checksum import seal, unseal  # noqa: E402
from store.integrity import write_version_checksums  # noqa: E402
from store.manifest import FILE_STRUCT  # noqa: E402
from store.manifest_files import checked_manifest  # noqa: E402
from store.version_counts import counted  # noqa: E402


def old_counts(vdir: Path) -> dict[str, Any]:
    d: dict[str, Any] = {}
    m = checked_manifest(vdir)
    shards = dict(zip(m.column("shard").to_pylist(), m.column("shard_nbytes").to_pylist()))
    d.update(samples=m.num_rows, shards=len(shards), bytes=sum(shards.values()))
    if "split" in m.column_names:
        d["splits"] = dict(Counter(m.column("split").to_pylist()))
    cols = m.column_names
    if "bucket" in cols:
        sizes = [tuple(b) for b in m.column("bucket").to_pylist()]
    else:
        sizes = [(s[0][1] * 16, s[0][2] * 16) for s in m.column("img_shapes").to_pylist()]
    d["buckets"] = {f"{h}x{w}": n for (h, w), n in sorted(Counter(sizes).items())}
    if "control_sizes" in m.column_names:
        sizes = [tuple(s) for row in m.column("control_sizes").to_pylist() for s in (row or [])]
        d["control_buckets"] = {f"{h}x{w}": n for (h, w), n in sorted(Counter(sizes).items())}
    return d


def new_counts(vdir: Path) -> dict[str, Any]:
    d = inspect._describe_version(vdir, int(vdir.name[1:]))
    return {k: d[k] for k in ("samples", "shards", "bytes", "splits", "buckets", "control_buckets") if k in d}


# ---------------------------------------------------------------- --synthetic: recorded counts vs counted columns

SHARD_ROWS = 50  # ~20k shards at 1M samples, as 256 MB shards of a real images table


def _images_manifest(n: int, seed: int) -> pa.Table:
    """An images manifest of n rows: the real columns, values of the right shapes (sizes of a few buckets)."""
    rng = np.random.default_rng(seed)
    keys = np.sort(rng.integers(0, 2**63, n, dtype=np.int64))
    key = pa.array([f"{k:032x}" for k in keys.tolist()], pa.string())
    shard_no = rng.permutation(n) // SHARD_ROWS  # shards filled in write order, not key order
    names = np.array([f"shard-r00-{i:06d}.tar" for i in range(shard_no.max() + 1)], object)
    shard_nbytes = (rng.integers(200, 260, shard_no.max() + 1) << 20)[shard_no]
    buckets = np.array([[1024, 1024], [896, 1152], [1152, 896], [768, 1344], [1344, 768]])
    b = buckets[rng.integers(0, len(buckets), n)]
    controls = rng.integers(0, 3, n)
    members = controls + 1  # target.png + each control's png
    offsets = pa.array(np.concatenate([[0], np.cumsum(members)]).astype(np.int32))
    files = pa.ListArray.from_arrays(offsets, pa.StructArray.from_arrays(
        [pa.array(["target.png", "control_0.png"]).take(pa.array(np.arange(members.sum()) % 2)),
         pa.array(rng.integers(0, 2**28, members.sum())), pa.array(rng.integers(2**16, 2**21, members.sum()))],
        fields=list(FILE_STRUCT)))
    c_off = pa.array(np.concatenate([[0], np.cumsum(controls)]).astype(np.int32))
    control_sizes = pa.ListArray.from_arrays(c_off, pa.array(
        [[896, 1152]] * int(controls.sum()), pa.list_(pa.int64())))
    shapes_off = pa.array(np.concatenate([[0], np.cumsum(members)]).astype(np.int32))
    flat = np.repeat(b // 16, members, axis=0)
    img_shapes = pa.ListArray.from_arrays(shapes_off, pa.array(
        np.column_stack([np.ones(len(flat), np.int64), flat]).tolist(), pa.list_(pa.int64())))
    crc = pa.array([f"{x:08x}" for x in rng.integers(0, 2**32, n).tolist()], pa.string())
    sha = pa.array([f"{x:064x}" for x in rng.integers(0, 2**63, n).tolist()], pa.string())
    return pa.table({
        "key": key, "shard": pa.array(names[shard_no], pa.string()), "shard_sha256": sha,
        "shard_nbytes": pa.array(shard_nbytes), "sample_offset": pa.array(rng.integers(0, 2**28, n)),
        "sample_nbytes": pa.array(rng.integers(2**16, 2**22, n)), "sample_sha256": sha,
        "tensors": pa.array([[]] * n, pa.list_(pa.struct([("name", pa.string())]))), "files": files,
        "shard_crc32c": crc, "sample_crc32c": crc,
        "split": pa.array(np.where(rng.random(n) < 0.05, "val", "train")),
        "bucket": pa.array(b.tolist(), pa.list_(pa.int64())), "control_sizes": control_sizes, "img_shapes": img_shapes,
        "caption": pa.array([f"caption of sample {i} with a few words more" for i in range(n)]),
        "source": pa.array([f"/data/source/target/sample_{i:07d}.png" for i in range(n)]),
    })


def build_synthetic(base: Path, n: int, versions: int) -> tuple[Path, Path]:
    """`base/n<N>x<V>/recorded` and `.../columns` (reused when complete)."""
    root = base / f"n{n}x{versions}"
    recorded, columns = root / "recorded", root / "columns"
    if (columns / "images" / f"v{versions}" / fmt.MANIFEST).is_file():
        return recorded, columns
    for store in (recorded, columns):
        store.mkdir(parents=True, exist_ok=True)
        (store / fmt.STORE_JSON).write_bytes(seal({"format": fmt.STORE_FORMAT, "format_version": 2,
                                                   "tables": {"images": {"current": versions}}}))
    lineage = {"stage": "resize-bucket", "config_hash": "bench", "model_fingerprint": "", "upstream": {},
               "code_version": "bench"}
    for v in range(1, versions + 1):
        table = _images_manifest(n, seed=v)
        data = fmt.parquet_bytes(table)
        vdir = recorded / "images" / f"v{v}"
        vdir.mkdir(parents=True)
        (vdir / fmt.SCHEMA_JSON).write_text(json.dumps({"table": "images", "schema_version": 2, "fields": [],
                                                        "lineage": lineage, "attrs": {}}))
        write_version_checksums(vdir, table, data, counts=counted(table))  # as a commit records them
        (vdir / fmt.MANIFEST).write_bytes(data)
        old = columns / "images" / f"v{v}"
        old.mkdir(parents=True)
        for name in (fmt.SCHEMA_JSON, fmt.MANIFEST):
            os.link(vdir / name, old / name)
        record = unseal((vdir / fmt.CHECKSUMS).read_bytes())
        del record["counts"]  # as committed before counts were recorded
        (old / fmt.CHECKSUMS).write_bytes(seal(record))
        print(f"built images v{v}: {n} rows, manifest {len(data) / 1e6:.0f} MB", flush=True)
    return recorded, columns


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def measure_one(store: Path) -> None:
    """In a fresh process: describe `store`; prints {"s", "rss_mb" (peak RSS over the RSS after imports: the
    manifests' mapped pages included, which are page cache), "arrow_mb" (Arrow's peak allocation: the decoded
    columns), "info"}."""
    from store.inspect import describe

    with open("/proc/self/clear_refs", "w") as f:  # "5": the peak RSS (VmHWM) starts again from here
        f.write("5")
    base = _status_mb("VmRSS")
    t0 = time.perf_counter()
    info = describe(store)
    s = time.perf_counter() - t0
    info["store"] = ""
    print(json.dumps({"s": s, "rss_mb": _status_mb("VmHWM") - base,
                      "arrow_mb": pa.default_memory_pool().max_memory() / 2**20, "info": info}))


def synthetic(args: argparse.Namespace) -> None:
    recorded, columns = build_synthetic(args.dir, args.synthetic, args.versions)
    best: dict[str, float] = {}
    peak: dict[str, float] = {}
    arrow: dict[str, float] = {}
    infos: dict[str, Any] = {}
    for _ in range(args.repeat):
        for name, store in (("columns", columns), ("recorded", recorded)):
            out = subprocess.run([sys.executable, __file__, "--one", str(store)], check=True, capture_output=True,
                                 text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
            r = json.loads(out.strip().splitlines()[-1])
            best[name] = min(best.get(name, 1e9), r["s"])
            peak[name] = max(peak.get(name, 0.0), r["rss_mb"])
            arrow[name] = max(arrow.get(name, 0.0), r["arrow_mb"])
            infos[name] = r["info"]
    assert infos["columns"] == infos["recorded"], "the two ways describe the store differently"
    for name in best:
        print(f"{name:>8}: {best[name]:.2f} s, peak RSS +{peak[name]:.0f} MB, Arrow peak {arrow[name]:.0f} MB")
    print(f"{args.synthetic} rows x {args.versions} versions: recorded {best['columns'] / best['recorded']:.1f}x "
          "faster than columns")


def url_inspect(args: argparse.Namespace) -> None:
    """--url: `store inspect` of each synthetic store as a file:// URL (store/remote_view.py): the bytes its metadata
    copy reads from the URL and the time, recorded counts (manifests left at the URL) against none (fetched)."""
    from store import remote as remote_mod
    from store.remote_view import metadata_copy

    recorded, columns = build_synthetic(args.dir, args.synthetic, args.versions)
    fetched = [0]
    real_read = remote_mod.Remote.read

    def read(self, rel, small=False):
        data = real_read(self, rel, small)
        fetched[0] += len(data)
        return data

    remote_mod.Remote.read = read
    infos = {}
    for _ in range(args.repeat):
        for name, store in (("columns", columns), ("recorded", recorded)):
            fetched[0] = 0
            t0 = time.perf_counter()
            with metadata_copy(f"file://{store}") as copy:
                infos[name] = {**inspect.describe(copy.root, copy.manifests_at_url), "store": ""}
            print(f"{name:>8}: {time.perf_counter() - t0:.2f} s, {fetched[0] / 1e6:.1f} MB read from the URL",
                  flush=True)
    assert infos["columns"] == infos["recorded"], "the two ways describe the store differently"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", type=Path, nargs="?")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--synthetic", type=int, metavar="N", help="rows per version of a synthetic images table")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/inspect-counts"))
    ap.add_argument("--url", action="store_true", help="with --synthetic: inspect each store as a file:// URL")
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return measure_one(args.one)
    if args.synthetic:
        return url_inspect(args) if args.url else synthetic(args)
    vdirs = [args.store / t / "v1" for t in ("images", "text", "vae")]
    for v in vdirs:
        assert old_counts(v) == new_counts(v), v
    times: dict[str, float] = {}
    for _ in range(args.repeat):
        for name, fn in (("old", old_counts), ("new", new_counts)):
            t0 = time.perf_counter()
            for v in vdirs:
                fn(v)
            times[name] = min(times.get(name, 1e9), time.perf_counter() - t0)
    print(f"{args.store}: old {times['old']:.1f} s, new {times['new']:.1f} s, {times['old'] / times['new']:.1f}x")


if __name__ == "__main__":
    main()
