"""`store repair`'s scan of one table version (store/repair.py `scan_table`: every shard's CRC, every sample's, the
files derived from the manifest) at many shards, an old revision against this checkout, each in a fresh process
over the same store (the old code unpacked by bench/old_vs_new.py, runs interleaved, medians).

Before, the check of the derived files (the shard indexes) rebuilt the set of every sample's shard for each
checksums.json entry: O(shards x samples), ~12 s of a 14 s scan at 20k samples in 5,000 shards, ~28 s of 31 s in
10,000, and ~20 min at 1M samples in 20k shards (a real 256 MB-shard store of 1M samples has ~20-30k shards).

    python bench/repair_scan.py HEAD~1 --samples 20000 --per-shard 2 [--work /tmp/repair-scan]

2-core dev machine shared with other jobs, page cache, 20,000 samples in 10,000 shards (10,000 indexes + tars):
  old 30.7 s   new 2.4 s   12.7x   (the rest: each shard's and each sample's CRC, which grow linearly)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "store"))

from old_vs_new import bench_folders, env_for, interleaved_medians, old_tree  # noqa: E402

SCAN = ("import sys, time; from pathlib import Path; from store import repair; t = time.perf_counter(); "
        "p = repair.scan_table(Path(sys.argv[1]), 'vae', 1, progress=False); "
        "print(time.perf_counter() - t, p.samples, len(p.intact_shards), p.needs_repair)")


def build(root: Path, samples: int, per_shard: int) -> Path:
    """A `vae` v1 of `samples` tiny samples, about `per_shard` to a shard (reused when complete)."""
    import torch

    from store import Store
    from store_samples import key_of, vae_schema

    if (root / "vae" / "v1" / "manifest.parquet").is_file():
        return root
    w = Store(root).writer("vae", vae_schema(), shard_size_mb=per_shard * 1400 / 1e6)  # ~1.4 kB a sample on disk
    t = torch.zeros(4, 1, 2, 2, dtype=torch.bfloat16)
    for i in range(samples):
        w.add(key_of(i), tensors={"target": t}, meta={"split": "train", "img_shapes": [[1, 1, 1]]})
    w.commit()
    return root


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", help="git revision to compare with")
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--per-shard", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--work", type=Path)
    args = ap.parse_args()
    with bench_folders(args, "repair-scan-") as (tmp, work):
        t0 = time.perf_counter()
        store = build((work / f"n{args.samples}-p{args.per_shard}").resolve(), args.samples, args.per_shard)
        shards = len(list((store / "vae" / "v1").glob("*.tar")))
        print(f"store: {args.samples} samples in {shards} shards ({time.perf_counter() - t0:.0f} s to build or find)")
        old = old_tree(args.old, tmp)
        seen = {}

        def run(tree: Path, label: str) -> list[float]:
            out = subprocess.run([sys.executable, "-c", SCAN, str(store)], env=env_for(tree), check=True, cwd=tree,
                                 capture_output=True, text=True).stdout.split()
            seen[label] = out[1:]
            return [float(out[0])]

        (o,), (n,) = interleaved_medians(args.repeat, lambda: run(old, "old"), lambda: run(ROOT, "new"))
        assert seen["old"] == seen["new"], seen  # the same plan's figures
        print(f"scan_table  old {o:.1f} s   new {n:.1f} s   {o / n:.1f}x")


if __name__ == "__main__":
    main()
