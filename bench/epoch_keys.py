"""A rank's epoch order at scale: `TableReader.iter_keys` (encode: each rank's share of the `images` table) and
`JoinedTables.iter_keys` (text + vae), one rank of --world-size, on synthetic tables of --samples keys in shards
of --per-shard samples (~30k shards at 1M samples, as `bench/store_scale.py`'s ~256 MB shards).

Measures, each in a fresh process (built once in --dir, reused on reruns), in the same run:
  old   the former order (every key of the table as a Python str, grouped into Python lists by shard, the
        table's `shard` / `split` columns kept as Python lists by the reader), kept below as the baseline - and
        the reference of tests/store/test_epoch_order_reference.py
  new   the order worked out on row numbers (store/partition.py `epoch_positions`), this rank's keys only
Prints time, peak and held Python + numpy memory (tracemalloc, in a separate run from the timing; held: the
result and what the reader keeps, for its life) and old / new; checks both give the same keys.

    python bench/epoch_keys.py --samples 1000000 --world-size 8
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one

from schemas.errors import UserError  # noqa: E402
from store import format as fmt  # noqa: E402
from store.partition import buffer_shuffle, rank_slice, rng_for  # noqa: E402
from store.reader import TableReader  # noqa: E402

# ------------------------------------------------------------ the former order (store/ at c4c67e3), verbatim


def old_shuffle_groups(groups, seed, epoch):
    order = list(range(len(groups)))
    rng_for(seed, epoch).shuffle(order)
    return [item for g in order for item in groups[g]]


def old_epoch_order(groups, rank=0, world_size=1, seed=None, epoch=0, buffer_size=1024):
    flat = [x for g in groups for x in g] if seed is None else old_shuffle_groups(groups, seed, epoch)
    start, stop = rank_slice(len(flat), rank, world_size)
    mine = flat[start:stop]
    if seed is None:
        return mine
    return buffer_shuffle(mine, buffer_size, rng_for(seed, epoch, rank))


def old_shard_groups(r: TableReader, split=None) -> list[list[str]]:
    view = r.view
    splits = view.values("split") if split is not None and view.has_column("split") else None
    if split is not None and splits is None:
        raise UserError(f"table '{r.table}' v{r.version} has no split column")
    groups: dict[str, list[str]] = {}
    for i, (k, s) in enumerate(zip(view.keys.as_list(), view.values("shard"))):
        if splits is None or splits[i] == split:
            groups.setdefault(s, []).append(k)
    return [groups[s] for s in sorted(groups)]


def old_iter_keys(r: TableReader, split=None, rank=0, world_size=1, seed=None, epoch=0, buffer_size=1024):
    return old_epoch_order(old_shard_groups(r, split), rank, world_size, seed, epoch, buffer_size)


def old_joined_iter_keys(j, rank=0, world_size=1, seed=None, epoch=0, buffer_size=1024):
    keep = set(j.keys)
    groups = [[k for k in g if k in keep] for g in old_shard_groups(next(iter(j.readers.values())), j.split)]
    return old_epoch_order([g for g in groups if g], rank, world_size, seed, epoch, buffer_size)


# ------------------------------------------------------------ synthetic tables


def build(root: Path, n: int, per_shard: int) -> None:
    if (root / "vae" / "v1" / fmt.MANIFEST).is_file():
        return
    rng = np.random.default_rng(0)
    keys = np.sort(np.frombuffer(rng.bytes(16 * n), dtype="S16"))
    keys = pa.array([k.hex() for k in keys.tolist()], pa.string())
    split = pa.array(np.where(rng.random(n) < 0.05, "val", "train"))
    for table in ("text", "vae"):
        vdir = root / table / "v1"
        vdir.mkdir(parents=True)
        shard = rng.permutation(n) // per_shard  # shards filled in a random (write) order, as encode ranks do
        names = np.array([fmt.shard_name(s % 64, s // 64) for s in range(int(shard.max()) + 1)])
        for name in names:
            (vdir / name).touch()  # empty: shard_nbytes 0
        empty = pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array([], pa.null()))
        manifest = pa.table({
            "key": keys, "shard": pa.array(names[shard]), "shard_sha256": pa.array(np.full(n, "0" * 64)),
            "shard_nbytes": pa.array(np.zeros(n, np.int64)), "sample_offset": pa.array(np.zeros(n, np.int64)),
            "sample_nbytes": pa.array(np.zeros(n, np.int64)), "sample_sha256": pa.array(np.full(n, "0" * 64)),
            "tensors": empty, "files": empty, "split": split,
        })
        (vdir / fmt.SCHEMA_JSON).write_text(json.dumps({
            "table": table, "schema_version": 2, "fields": [], "attrs": {},
            "lineage": {"stage": f"encode-{table}", "config_hash": "bench", "model_fingerprint": "bench",
                        "upstream": {}, "code_version": "bench"}}))
        fmt.atomic_write_parquet(vdir / fmt.MANIFEST, manifest)  # format 1 (no checksums): nothing to seal


def measure(root: Path, impl: str, what: str, mode: str, rank: int, world: int) -> dict:
    """One measurement in this (fresh) process: open, then time or trace the rank's epoch order."""
    from store.join import JoinedTables

    readers = {t: TableReader(root / t / "v1", t, 1) for t in ("text", "vae")}
    args = dict(rank=rank, world_size=world, seed=0, epoch=1)
    if what == "reader":  # encode's use: the images table, no split, the stored order
        r = readers["vae"]
        fn = (lambda: old_iter_keys(r, **{**args, "seed": None})) if impl == "old" else \
            (lambda: r.iter_keys(**{**args, "seed": None}))
    else:
        j = JoinedTables(readers, "train", root)
        fn = (lambda: old_joined_iter_keys(j, **args)) if impl == "old" else (lambda: j.iter_keys(**args))
    if mode == "time":
        t0 = time.perf_counter()
        keys = fn()
        return {"s": time.perf_counter() - t0, "n": len(keys),
                "digest": hashlib.sha256("\n".join(keys).encode()).hexdigest()}
    tracemalloc.start()
    start = tracemalloc.get_traced_memory()[0]
    keys = fn()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"peak_mb": (peak - start) / 2**20, "held_mb": (held - start) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--per-shard", type=int, default=33)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--rank", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench-epoch-keys"))
    ap.add_argument("--one", nargs=3, metavar=("IMPL", "WHAT", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    root = a.dir / str(a.samples)
    if a.one:
        print(json.dumps(measure(root, *a.one, a.rank, a.world_size)))
        return
    build(root, a.samples, a.per_shard)
    out: dict = {"samples": a.samples, "world_size": a.world_size}

    def run(*one: str) -> dict:
        cmd = [sys.executable, __file__, "--samples", str(a.samples), "--world-size", str(a.world_size),
               "--rank", str(a.rank), "--dir", str(a.dir), "--one", *one]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

    for what in ("reader", "joined"):
        got = {impl: {**run(impl, what, "time"), **run(impl, what, "memory")} for impl in ("old", "new")}
        assert got["old"]["digest"] == got["new"]["digest"] and got["old"]["n"] == got["new"]["n"], "orders differ"
        row = {f"{impl}_{k}": round(v, 2) for impl, m in got.items() for k, v in m.items() if k not in ("digest", "n")}
        row["keys"] = got["new"]["n"]
        for k in ("s", "peak_mb", "held_mb"):
            row[f"{k}_old_over_new"] = round(got["old"][k] / max(got["new"][k], 1e-3), 1)
        out[what] = row
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
