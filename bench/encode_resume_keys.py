"""One rank of a killed encode resuming (a writer opened with its `share`, store/writer_open.py): which keys of its
share are committed already. Synthetic unfinished version: --samples keys written by --world-size ranks, each
rank's contiguous share (encode's `iter_keys`) in shards of --per-shard samples (~30k index files at 1M samples,
as `bench/store_scale.py`'s ~256 MB shards), the index columns a real encode writes; --done of each share
committed.

Measures rank --rank, each in a fresh process (built once in --dir, reused on reruns), in the same run:
  old        the former way (store/ at c4c67e3, kept below): every rank's indexes read (`pq.read_table`), every
             committed key of the version as a Python str in one set, in every rank
  same       resumed with the same world size: this rank's own indexes only
  moved      resumed with --moved-world-size ranks (the shares moved): every index's key column, only the keys
             of this rank's share kept
Prints time, peak RSS growth over the process before the step, index files read, and old / new. The files sit
in the page cache here; on a shared file system each index costs a metadata round trip more, and every rank of
the job reads them at once (old: world_size x every index).

    python bench/encode_resume_keys.py --samples 1000000 --world-size 64
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one

from store import format as fmt  # noqa: E402
from store import writer_open  # noqa: E402
from store.manifest import CHECKSUM_FIELDS, LOCATING_FIELDS  # noqa: E402
from store.partition import rank_slice  # noqa: E402


def old_committed_keys(vdir: Path) -> set[str]:
    """store/writer_open.py `committed_keys` at c4c67e3 (its error handling left out): run in every rank."""
    keys: set[str] = set()
    for p in sorted(vdir.glob("shard-r*-*.index.parquet")):
        keys.update(pq.read_table(p, columns=["key"]).column("key").to_pylist())
    return keys


def key(i: int) -> str:
    return f"{i * 0x9E3779B97F4A7C15 % 2**128:032x}"  # distinct, hash-like


def share(n: int, rank: int, world: int) -> list[str]:
    """Rank's keys, without building every rank's (the measured process's peak before the step stays small)."""
    return [key(i) for i in range(*rank_slice(n, rank, world))]


def build(vdir: Path, n: int, world: int, per_shard: int, done: float) -> None:
    if (vdir / "built").is_file():
        return
    vdir.mkdir(parents=True, exist_ok=True)
    keys = [key(i) for i in range(n)]
    schema = pa.schema(LOCATING_FIELDS + CHECKSUM_FIELDS + [
        pa.field("split", pa.string()), pa.field("img_shapes", pa.list_(pa.list_(pa.int64()))),
        pa.field("num_controls", pa.int64()), pa.field("latent_shapes", pa.list_(pa.list_(pa.int64()))),
        pa.field("has_mask", pa.bool_()), pa.field("mask_sha256", pa.string())])
    tensor = [{"name": "target", "offset": 1024, "nbytes": 2 << 20, "dtype": "bfloat16", "shape": [16, 1, 64, 64]}]
    for rank in range(world):
        a, b = rank_slice(n, rank, world)
        b = a + int((b - a) * done)
        for j, s in enumerate(range(a, b, per_shard)):
            ks = sorted(keys[s:min(b, s + per_shard)])
            m, name = len(ks), fmt.shard_name(rank, j)
            cols = {"key": ks, "shard": [name] * m, "shard_sha256": ["0" * 64] * m, "shard_nbytes": [m << 21] * m,
                    "sample_offset": list(range(0, m << 21, 1 << 21)), "sample_nbytes": [1 << 21] * m,
                    "sample_sha256": ["0" * 64] * m, "tensors": [tensor] * m, "files": [[]] * m,
                    "shard_crc32c": ["00000000"] * m, "sample_crc32c": ["00000000"] * m,
                    "split": ["train"] * m, "img_shapes": [[[1, 32, 32]]] * m, "num_controls": [0] * m,
                    "latent_shapes": [[[16, 1, 64, 64]]] * m, "has_mask": [False] * m, "mask_sha256": [""] * m}
            fmt.atomic_write_parquet(vdir / fmt.index_name(name), pa.Table.from_pydict(cols, schema=schema))
    (vdir / "built").touch()


def measure(vdir: Path, how: str, n: int, rank: int, world: int, moved: int) -> dict:
    """One rank's step in this (fresh) process: which keys of its share are committed."""
    ranks_now = moved if how == "moved" else world
    mine = share(n, rank % ranks_now, ranks_now)
    indexes = writer_open.index_paths(vdir)
    read = []
    real = writer_open.index_keys

    def counted(p: Path) -> pa.Array:
        read.append(p)
        return real(p)

    # one-time costs out of both measurements: imports (pyarrow.parquet pulls in pandas), the memory pool
    pq.read_table(indexes[0], columns=["key"])
    writer_open.committed_in_share(indexes[:1], -1, 1, pa.array(mine[:1], pa.string()), lambda alone: False)
    writer_open.index_keys = counted
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if how == "old":
        done = old_committed_keys(vdir)
        files = len(indexes)
    else:
        done = writer_open.committed_in_share(indexes, rank % ranks_now, ranks_now, pa.array(mine, pa.string()),
                                              lambda alone: alone)
        files = len(read)
    todo = [k for k in mine if k not in done]
    seconds = time.perf_counter() - t0
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    return {"s": seconds, "peak_rss_mb": peak, "files": files, "todo": len(todo),
            "skipped": len(mine) - len(todo)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--moved-world-size", type=int, default=32)
    ap.add_argument("--rank", type=int, default=5)
    ap.add_argument("--per-shard", type=int, default=33)
    ap.add_argument("--done", type=float, default=0.5, help="fraction of each share committed before the kill")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench-encode-resume"))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    vdir = a.dir / f"{a.samples}-{a.world_size}-{a.per_shard}-{a.done}" / "vae" / "v1"
    if a.one:
        print(json.dumps(measure(vdir, a.one, a.samples, a.rank, a.world_size, a.moved_world_size)))
        return
    build(vdir, a.samples, a.world_size, a.per_shard, a.done)

    def run(how: str) -> dict:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", how]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

    got = {how: run(how) for how in ("old", "same", "moved")}
    assert got["old"]["todo"] == got["same"]["todo"], "the same world: old and new disagree"
    out = {"samples": a.samples, "world_size": a.world_size, "moved_world_size": a.moved_world_size,
           "index_files": len(writer_open.index_paths(vdir)),
           **{f"{how}_{k}": round(v, 2) for how, m in got.items() for k, v in m.items()}}
    for how in ("same", "moved"):
        for k in ("s", "peak_rss_mb", "files"):
            out[f"{k}_old_over_{how}"] = round(got["old"][k] / max(got[how][k], 1e-3), 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
