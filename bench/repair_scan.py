"""`store repair`'s scan of one table version (store/repair.py `scan_table`: every shard's CRC, every sample's, the
files derived from the manifest) at many shards, an old revision against this checkout, each in a fresh process
over the same store (the old code unpacked by bench/old_vs_new.py, runs interleaved, medians).

Before, the check of the derived files (the shard indexes) rebuilt the set of every sample's shard for each
checksums.json entry: O(shards x samples), ~12 s of a 14 s scan at 20k samples in 5,000 shards, ~28 s of 31 s in
10,000, and ~20 min at 1M samples in 20k shards (a real 256 MB-shard store of 1M samples has ~20-30k shards).

    python bench/repair_scan.py HEAD~1 --samples 20000 --per-shard 2 [--work /tmp/repair-scan]

2-core dev machine shared with other jobs, page cache, 20,000 samples in 10,000 shards (10,000 indexes + tars):
  old 30.7 s   new 2.4 s   12.7x   (the rest: each shard's and each sample's CRC, which grow linearly)

Then every sample's bytes were read a second time after the whole-file pass had shown its shard intact (the
CRC32C the writer took of the shard as it wrote it: the very bytes each sample's CRC was taken of); now only the
samples of shards that fail it are. Bytes read = bytes through CRC32C (the scan reads only to checksum).

    python bench/repair_scan.py 3f2c4a3 --samples 10000 --per-shard 2 --kb 64 --repeat 3 [--cold]

Same machine (load average ~5), 10,000 samples of a 64 kB latent in 3,334 shards (683 MB of shards, 26 MB of
indexes and other files), medians of 3:
  page cache:            old 1.23 s, 1374.7 MB read   new 0.72 s, 709.1 MB read   1.7x time, 1.94x bytes
  --cold (evicted once): old 2.65 s, 1374.7 MB read   new 2.20 s, 709.1 MB read   1.2x time, 1.94x bytes
The cold store here fits in memory, so the old second pass still found its pages cached from the first; a store
larger than memory (TBs of latents at 1M samples) reads them from the disk again: about half the scan's time.
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
from store_read import evict  # noqa: E402  (drops the files' pages: the --cold scan reads the disk)

# bytes read of the version = bytes through CRC32C: the scan reads a file's bytes only to checksum them, by read or
# through a map alike (a map's page faults pass no read call: the kernel's rchar misses them)
SCAN = ("import sys, time, crc32c; from pathlib import Path; from store import repair; n = [0]; real = crc32c.crc32c\n"
        "def counted(d, v=0):\n n[0] += memoryview(d).nbytes; return real(d, v)\n"
        "crc32c.crc32c = counted; t = time.perf_counter(); "
        "p = repair.scan_table(Path(sys.argv[1]), 'vae', 1, progress=False); "
        "print(time.perf_counter() - t, n[0], p.samples, len(p.intact_shards), p.needs_repair)")


def build(root: Path, samples: int, per_shard: int, kb: int = 0) -> Path:
    """A `vae` v1 of `samples` samples (tiny, or a `kb` kB latent each), about `per_shard` to a shard (reused when
    complete)."""
    import torch

    from store import Store
    from store_samples import key_of, vae_schema

    if (root / "vae" / "v1" / "manifest.parquet").is_file():
        return root
    side = max(2, int((kb * 1024 / 8) ** 0.5))  # 4 x 1 x side x side bf16
    on_disk = 1400 + 8 * side * side  # ~1.4 kB a tiny sample on disk
    w = Store(root).writer("vae", vae_schema(), shard_size_mb=per_shard * on_disk / 1e6)
    t = torch.ones(4, 1, side, side, dtype=torch.bfloat16)
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
    ap.add_argument("--kb", type=int, default=0, help="each sample's latent, in kB (0: tiny samples)")
    ap.add_argument("--cold", action="store_true", help="evict the version's files from the page cache before each "
                    "scan (posix_fadvise DONTNEED): its bytes come from the disk")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--work", type=Path)
    args = ap.parse_args()
    with bench_folders(args, "repair-scan-") as (tmp, work):
        t0 = time.perf_counter()
        store = build((work / f"n{args.samples}-p{args.per_shard}-k{args.kb}").resolve(), args.samples,
                      args.per_shard, args.kb)
        files = [p for p in (store / "vae" / "v1").iterdir() if p.is_file()]
        tars = [p for p in files if p.suffix == ".tar"]
        mb = sum(p.stat().st_size for p in tars) / 1e6
        print(f"store: {args.samples} samples in {len(tars)} shards, {mb:.1f} MB of shards, "
              f"{sum(p.stat().st_size for p in files) / 1e6 - mb:.1f} MB of other files "
              f"({time.perf_counter() - t0:.0f} s to build or find)")
        old = old_tree(args.old, tmp)
        seen = {}

        def run(tree: Path, label: str) -> list[float]:
            if args.cold:
                evict(files)
            out = subprocess.run([sys.executable, "-c", SCAN, str(store)], env=env_for(tree), check=True, cwd=tree,
                                 capture_output=True, text=True).stdout.split()
            seen[label] = out[2:]
            return [float(out[0]), float(out[1])]

        (o, ob), (n, nb) = interleaved_medians(args.repeat, lambda: run(old, "old"), lambda: run(ROOT, "new"))
        assert seen["old"] == seen["new"], seen  # the same plan's figures
        print(f"scan_table  old {o:.2f} s, {ob / 1e6:.1f} MB read   new {n:.2f} s, {nb / 1e6:.1f} MB read   "
              f"{o / n:.1f}x time, {ob / nb:.2f}x bytes")


if __name__ == "__main__":
    main()
