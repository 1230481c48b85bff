"""A relabel's carry forward (`store.reuse.carry_forward`, as resize-bucket's relabel, repair's intact shards and
the encode stages' carried samples do) over a real store of N samples (bench/scale_store.py builds it): each shard
hard-linked into the new version with its index. Each linked shard used to fsync the version folder after its
index (~590 at 100k samples, ~1,770 at 300k, ~6-20k at 1M); the folder is now fsynced once, before the rank's done
file. Measures, each in a fresh process on its own scratch copy of the store (hard links: the store is not
changed), interleaved, --repeat times, after checking both write the same manifest.parquet and checksums.json:
  old   the former per-shard folder fsync (every `atomic_write_bytes` made to fsync its folder, as before)
  new   the code as it is
the whole relabel (bench/scale_ops.py `relabel`: read v1's manifest, the split flipped for every 7th sample,
carry_forward, commit), its os.fsync calls and their seconds, and the seconds. Prints old / new.

    python bench/carry_fsync.py --samples 30000 100000 --dir /tmp/scale

2-core machine shared with other helpers (load ~6, the times swing), ext4 on a virtual disk, best of 2
(a first run: 100k 8.3 -> 6.2 s, 300k 14.7 -> 17.4 s: the disk's fsyncs swing with the other jobs' writes):
  N=100k   590 shards   old  4.4 s, 1193 fsyncs 1.2 s   new  3.7 s,  603 fsyncs 0.5 s   1.18x time, 2.3x fsync
  N=300k  1769 shards   old 14.0 s, 3551 fsyncs 2.5 s   new 12.4 s, 1782 fsyncs 1.4 s   1.14x time, 1.8x fsync
The fsyncs left are each linked index's bytes (before its name exists: a name that survives a power loss has its
bytes), and the commit's own files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from scale_ops import RELABEL  # noqa: E402

CHILD = """
import json, os, sys, time
sys.path.insert(0, {root!r})
from store import format as fmt
fsyncs = [0, 0.0]
real_fsync = os.fsync
def counted(fd):
    t = time.perf_counter()
    real_fsync(fd)
    fsyncs[0] += 1
    fsyncs[1] += time.perf_counter() - t
os.fsync = counted
if sys.argv[2] == "old":  # the folder fsynced after every index, as before
    write = fmt.atomic_write_bytes
    fmt.atomic_write_bytes = lambda path, data, replace=True, sync_dir=True: write(path, data, replace, True)
t0 = time.perf_counter()
{relabel}
print(json.dumps({{"s": time.perf_counter() - t0, "fsyncs": fsyncs[0], "fsync_s": fsyncs[1]}}))
"""


def digest(vdir: Path) -> str:
    return hashlib.sha256(b"".join((vdir / n).read_bytes() for n in ("manifest.parquet", "checksums.json"))).hexdigest()


def run(root: Path, scratch: Path, side: str) -> dict:
    shutil.rmtree(scratch, ignore_errors=True)
    subprocess.run(["cp", "-al", str(root), str(scratch)], check=True)
    for p in scratch.rglob("*.json"):  # store.json and friends are replaced by writes: own copies, not links
        data = p.read_bytes()
        p.unlink()
        p.write_bytes(data)
    code = CHILD.format(root=str(ROOT), relabel=RELABEL)
    out = subprocess.run([sys.executable, "-c", code, str(scratch), side], check=True, capture_output=True,
                         text=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    res["digest"] = digest(scratch / "images" / "v2")
    shutil.rmtree(scratch, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[100_000])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/scale"))
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    from scale_store import build

    for n in args.samples:
        root = build(args.dir, n)
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for _ in range(args.repeat):  # interleaved: a busy machine slows both alike
            for side in runs:
                runs[side].append(run(root, args.dir / f"carry-{n}", side))
        assert len({r["digest"] for rs in runs.values() for r in rs}) == 1, "the written versions differ"
        o, w = (min(rs, key=lambda r: r["s"]) for rs in runs.values())
        fo, fw = (min(r["fsync_s"] for r in rs) for rs in runs.values())
        print(f"N={n}: old {o['s']:.1f} s, {o['fsyncs']} fsyncs {fo:.1f} s; new {w['s']:.1f} s, {w['fsyncs']} fsyncs "
              f"{fw:.1f} s; old / new {o['s'] / w['s']:.2f}x time, {fo / fw:.2f}x fsync time", flush=True)


if __name__ == "__main__":
    main()
