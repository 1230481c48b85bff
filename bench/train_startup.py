"""A training rank's start over a store of --samples (1M) samples, step by step: seconds, the peak memory of each step
and the private memory it leaves held, an old revision's code against this checkout's, in the same run.

    python bench/train_startup.py OLD_REV [--samples 1000000] [--repeat 2] [--dir /dev/shm/store-scale]

The store is bench/store_scale.py's synthetic `text` + `vae` (built once per N, reused; realistic manifests, ~22k
shards a table, sparse shard files). Each tree runs in fresh processes (old, new, old, new, ...; the median of the
repeats), one per sampler (`length`: fixed batches of 4; `budget`: train.max_tokens_per_batch 16384), 8 ranks
planned, as rank 3. The steps are what every rank does before its first optimizer step, in the trainer's order
(the model aside): open the two readers, join the train split, the dropped report (over an `images` version of
the same keys and splits, `images_version`), the sequence lengths, the version
ids, the locating columns (check-ahead's `prepare_checks`), the sampler and the epoch plans the stream and the
check-ahead walkers hold (epochs 0 and 1), this rank's first 100 samples of the read order. Per step: wall seconds,
peak (VmHWM, reset before the step, over the RSS the step began with) and held private memory (RssAnon after it,
freed memory returned to the system first, as the reader does). Totals over the interpreter after its imports
(torch included): held private MB, mapped manifest pages (RssFile: shared by the ranks of a node), the peak RSS.
2 shared cores: seconds swing with the load; memory is steadier.

Measured (old = 055036a, N = 1M, 949,856 train samples, median of 2, load average ~9 on 2 cores), MB over the
interpreter after its imports:
  step               peak old -> new   held private old -> new
  open readers        334 -> 323        +143 -> +129   manifest columns decoded a row group at a time
  join train split     99 -> 42          -34 -> -30    the usual case told on zero-copy key views
  dropped report      191 -> 54           +5 -> -3     images keys/splits a row group at a time, binary search
  sequence lengths    135 -> 109         +33 -> +35    img_shapes narrowed per group (no whole int64 decode)
  locating columns     53 -> 62          +17 -> +25    (per-group reads: ~8 MB more kept here, ~0.4 s slower)
  the start's peak    449 -> 350 (fixed batches), 435 -> 355 (token budget); held 176 -> 166, 178 -> 167;
                      + 150 -> 146 MB mapped manifest pages (shared by a node's ranks)
  token-budget plans, epochs 0 + 1: 3.14 -> 1.64 s (numpy's shuffles for runs started now; fixed batches: 0.97 ->
  0.95 s, numpy's already). Whole start: 12.3 -> 9.9 s (fixed), 15.8 -> 11.4 s (budget), under that load.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from old_vs_new import REPO, env_for, old_tree  # noqa: E402

CHILD = r"""
import gc, json, sys, time
from pathlib import Path
import torch  # noqa: F401 - in every rank's baseline
from store.arrow_columns import release_memory
from store.store import Store
from store.join import JoinedTables, sequence_lengths_of
from features.open import dropped_report
from stages.train.budget import make_sampler
from stages.train.data import DataStream
from stages.train import elastic
from stages.train.prefetch import read_order

def status():
    out = {}
    for line in open("/proc/self/status"):
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssFile", "RssShmem", "VmHWM", "VmRSS"):
            out[name] = int(value.split()[0]) / 1024
    return out

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

root, kind = Path(sys.argv[1]), sys.argv[2]
gc.collect(); release_memory(); reset_peak()
base = start = status()
steps, hwm, t = {}, base["VmRSS"], time.perf_counter()

def step(name):
    global start, t, hwm
    seconds, peak = time.perf_counter() - t, status()
    gc.collect(); release_memory()
    now = status()
    steps[name] = {"s": seconds, "peak_mb": peak["VmHWM"] - start["VmRSS"], "held_mb": now["RssAnon"] - start["RssAnon"]}
    hwm = max(hwm, peak["VmHWM"])
    reset_peak(); start, t = status(), time.perf_counter()

st = Store(root, create=False)
readers = {name: st.reader(name) for name in ("text", "vae")}; step("open readers")
for r in readers.values():  # encoded from the `images` version `images_version` added (bench/store_scale.py has none)
    r.schema.lineage.upstream["images"] = 1
joined = JoinedTables(readers, "train", st.root); step("join train split")
joined.report = dropped_report(st, joined, "train"); step("dropped report")
joined.lengths = sequence_lengths_of(joined); step("sequence lengths")
joined.versions(); step("version ids")
for r in readers.values():
    r.view.samples.prepare_checks()
step("locating columns")
sampler = make_sampler(joined.lengths, 4, 16384 if kind == "budget" else None, 0, 64, 8)
stream = DataStream(elastic.on_world(sampler, 8)); step("sampler")
stream.steps(0); step("plan epoch 0")
stream.steps(1); step("plan epoch 1")
order = read_order(stream, 3)
first = [next(order) for _ in range(100)]; step("read order (100)")
end = status()
print(json.dumps({"steps": steps, "held_mb": end["RssAnon"] - base["RssAnon"],
                  "file_mb": end["RssFile"] + end["RssShmem"] - base["RssFile"] - base["RssShmem"],
                  "peak_mb": hwm - base["VmRSS"], "samples": len(joined)}))
"""


def images_version(root: Path) -> None:
    """An `images` v1 of the store's samples, as the dropped report reads it: its manifest's key and split columns
    (the text table's), in row groups as the store writes them; no shards, no checksums (read as format 1)."""
    import pyarrow.parquet as pq

    sys.path.insert(0, str(REPO))
    from store import format as fmt

    vdir = root / "images" / "v1"
    if fmt.is_complete(vdir):
        return
    vdir.mkdir(parents=True, exist_ok=True)
    keys = pq.read_table(root / "text" / "v1" / fmt.MANIFEST, columns=["key", "split"])
    fmt.atomic_write_bytes(vdir / fmt.MANIFEST, fmt.parquet_bytes(keys))


def child(tree: Path, root: Path, kind: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(root), kind], env=env_for(tree), cwd=tree,
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", help="git revision to compare with (e.g. main)")
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--kinds", default="length,budget")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm/store-scale"),
                    help="bench/store_scale.py's folder (its stores are reused)")
    args = ap.parse_args()
    from store_scale import build

    root = args.dir / f"n{args.samples}"
    build(root, args.samples)
    images_version(root)
    with tempfile.TemporaryDirectory(prefix="train-startup-") as tmp:
        trees = {"old": old_tree(args.old, Path(tmp)), "new": REPO}
        for kind in args.kinds.split(","):
            runs: dict[str, list[dict]] = {"old": [], "new": []}
            for _ in range(args.repeat):
                for side, tree in trees.items():
                    runs[side].append(child(tree, root, kind))
            med = {side: {"steps": {name: {k: statistics.median(r["steps"][name][k] for r in rs) for k in ("s", "peak_mb",
                                                                                                        "held_mb")}
                                    for name in rs[0]["steps"]},
                          **{k: statistics.median(r[k] for r in rs) for k in ("held_mb", "file_mb", "peak_mb")}}
                   for side, rs in runs.items()}
            print(f"== {kind} sampler, N={args.samples:,} ({runs['new'][0]['samples']:,} train samples), 8 ranks, "
                  f"rank 3; median of {args.repeat}; old = {args.old}")
            print(f"{'step':20s} {'seconds old -> new':>20s} {'peak MB old -> new':>20s} {'held MB old -> new':>20s}")
            for name, new in med["new"]["steps"].items():
                old = med["old"]["steps"][name]
                print(f"{name:20s} {old['s']:9.2f} -> {new['s']:6.2f} {old['peak_mb']:9.0f} -> {new['peak_mb']:6.0f} "
                      f"{old['held_mb']:+9.0f} -> {new['held_mb']:+6.0f}")
            o, n = med["old"], med["new"]
            secs = {side: sum(s["s"] for s in med[side]["steps"].values()) for side in med}
            print(f"{'total':20s} {secs['old']:9.2f} -> {secs['new']:6.2f} {o['peak_mb']:9.0f} -> {n['peak_mb']:6.0f} "
                  f"{o['held_mb']:+9.0f} -> {n['held_mb']:+6.0f}   (+ {o['file_mb']:.0f} -> {n['file_mb']:.0f} MB of "
                  "mapped manifest pages, shared by a node's ranks)")
            print(f"old / new: held private x{o['held_mb'] / max(n['held_mb'], 1):.2f}, peak x"
                  f"{o['peak_mb'] / max(n['peak_mb'], 1):.2f}, seconds x{secs['old'] / max(secs['new'], 1e-3):.2f}; "
                  f"plans (epochs 0 + 1) {o['steps']['plan epoch 0']['s'] + o['steps']['plan epoch 1']['s']:.2f} -> "
                  f"{n['steps']['plan epoch 0']['s'] + n['steps']['plan epoch 1']['s']:.2f} s", flush=True)


if __name__ == "__main__":
    main()
