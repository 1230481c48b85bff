"""`store verify`'s per-sample member walk (store/verify.py `_members`): every tar header of every sample parsed.

Reads the samples of the first --shards shards of a table version (bench/scale_store.py stores: images, 6 members
per sample with 2 controls) and times, in the same run (best of --repeat, after checking both give the same
members):
  old   `tarfile.TarInfo.frombuf` for every header (kept below verbatim as the baseline)
  new   `_members`: the writer's plain headers parsed directly, anything else through frombuf
Under a profile frombuf was ~2/3 of a verify. 2-core shared machine, images v1 of bench/scale_store.py --samples
100000 (first 100 shards, 16,958 samples, 65,714 headers): old 1.34-5.13 s, new 0.35-1.40 s, 3.5-3.8x (load 5-7).
A whole `verify_store` of that store (images + text + vae, 100k samples each), same machine, old and new code
interleaved: old 28.7 / 19.8 s, new 12.0 / 11.0 s (~2x).

    python bench/verify_members.py /tmp/scale/n100000/images/v1 [--shards 100] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import time
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one

from store.verify import _members  # noqa: E402


def old_members(data: bytes, base: int) -> dict[str, tuple[int, int]] | None:
    out = {}
    pos = 0
    while pos < len(data):
        try:
            info = tarfile.TarInfo.frombuf(data[pos : pos + tarfile.BLOCKSIZE], "utf-8", "strict")
        except tarfile.TarError:
            return None
        out[info.name] = (base + pos + tarfile.BLOCKSIZE, info.size)
        pos += tarfile.BLOCKSIZE + info.size + (-info.size % tarfile.BLOCKSIZE)
    return out if pos == len(data) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("vdir", type=Path)
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    samples = []
    for index in sorted(args.vdir.glob("*.index.parquet"))[: args.shards]:
        rows = pq.read_table(index, columns=["shard", "sample_offset", "sample_nbytes"]).to_pylist()
        data = (args.vdir / rows[0]["shard"]).read_bytes()
        samples += [(data[r["sample_offset"] : r["sample_offset"] + r["sample_nbytes"]], r["sample_offset"])
                    for r in rows]
    assert all(old_members(d, b) == _members(d, b) for d, b in samples), "old and new disagree"
    times = {}
    for _ in range(args.repeat):
        for name, fn in (("old", old_members), ("new", _members)):
            t0 = time.perf_counter()
            for d, b in samples:
                fn(d, b)
            times[name] = min(times.get(name, 1e9), time.perf_counter() - t0)
    headers = sum(len(old_members(d, b)) for d, b in samples)
    print(f"{len(samples)} samples, {headers} headers: old {times['old']:.2f} s, new {times['new']:.2f} s, "
          f"{times['old'] / times['new']:.1f}x")


if __name__ == "__main__":
    main()
