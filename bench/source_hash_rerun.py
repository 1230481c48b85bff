"""A resize-bucket rerun's listing hash over an unchanged folder source (stages/resize/content.py
`content_listing_hash`: every file looked up in the file-hash cache, none read), an old revision against this
checkout, each in a fresh process with the cache already filled (the old code unpacked by bench/old_vs_new.py,
runs interleaved, medians).

Before, each file's cache lookup resolved its path twice with `os.path.realpath` (`FileHashes.sha256`, then again
in `cached`): one lstat per path component each time, ~20 lstats a file at depth 9, and two stats; now
`models.file_hashes.real_path` resolves each folder once per pass and the file with one lstat, and the stat is
shared. The source sits --depth folders deep (datasets live at /mnt/NAS/team/datasets/name/... and deeper); on a
network file system each lstat is a round trip unless cached.

    python bench/source_hash_rerun.py HEAD~1 --samples 50000 [--work /tmp/source-hash]

2-core dev machine shared with other jobs, local disk, page cache, 50,000 samples (150,000 files: target,
control, caption), source 9 folders deep (/tmp/ps/sh/d0/.../n50000):
  old 28.7 s   new 7.7 s   3.7x   (7.7 s: the sqlite lookups, the stats, the hashing of the listing)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from old_vs_new import bench_folders, env_for, interleaved_medians, old_tree  # noqa: E402

HASH = ("import sys, time; from stages.resize.content import content_listing_hash; t = time.perf_counter(); "
        "h = content_listing_hash(sys.argv[1]); print(time.perf_counter() - t, h)")


def build(root: Path, samples: int) -> Path:
    """A folder source of `samples` tiny target + control images and captions (reused when there)."""
    done = root / ".complete"
    if done.is_file():
        return root
    for d in ("target", "control"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for i in range(samples):
        (root / "target" / f"{i:07d}.png").write_bytes(b"t%d" % i)
        (root / "control" / f"{i:07d}.png").write_bytes(b"c%d" % i)
        (root / "target" / f"{i:07d}.txt").write_text(f"caption {i}")
    done.write_text("")
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", help="git revision to compare with")
    ap.add_argument("--samples", type=int, default=50000)
    ap.add_argument("--depth", type=int, default=8, help="folders between / and the source")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--work", type=Path)
    args = ap.parse_args()
    with bench_folders(args, "source-hash-") as (tmp, work):
        work = work.resolve()
        deep = work.joinpath(*[f"d{i}" for i in range(max(0, args.depth - len(work.parts) + 1))])
        t0 = time.perf_counter()
        source = build(deep / f"n{args.samples}", args.samples)
        print(f"source: {args.samples} samples, {len(source.parts) - 1} folders deep "
              f"({time.perf_counter() - t0:.0f} s to build or find)")
        old = old_tree(args.old, tmp)
        seen: dict[str, str] = {}

        def run(tree: Path, label: str) -> list[float]:
            env = {**env_for(tree), "XDG_CACHE_HOME": str(work / "cache")}  # one cache: filled by the first run
            out = subprocess.run([sys.executable, "-c", HASH, str(source)], env=env, check=True, cwd=tree,
                                 capture_output=True, text=True).stdout.split()
            seen[label] = out[1]
            return [float(out[0])]

        run(ROOT, "fill")  # every file hashed into the cache: the runs below are reruns
        (o,), (n,) = interleaved_medians(args.repeat, lambda: run(old, "old"), lambda: run(ROOT, "new"))
        assert seen["old"] == seen["new"] == seen["fill"], seen  # the same listing hash
        print(f"listing hash rerun  old {o:.1f} s   new {n:.1f} s   {o / n:.1f}x")


if __name__ == "__main__":
    main()
