"""Memory of a resumed resize-bucket's source -> key map (`stages/resize/resumed_sources.py`) at scale, against the
dict of str it replaced, measured in the same run on the same synthetic version folder.

A folder of shard indexes (`shard-r00-NNNNN.index.parquet`, `--per-shard` rows each, source names as a folder
source records them) is written once; each structure is then built in a fresh process, which reports the
memory it holds once built and its peak while building (tracemalloc: Python objects and numpy buffers; and
the resident set, RSS after - before and peak, which also counts pyarrow's pool and the allocator's free
arenas; "read" reads the indexes alike and keeps nothing: the floor), the build time and the time of one
lookup per sample (each checked). Extrapolate linearly.

    python bench/resumed_sources.py --samples 200000
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _old_dict(vdir: Path) -> dict[str, str]:
    """The structure before: {source: key} of str (as resumed_sources.py built it)."""
    import pyarrow.parquet as pq

    from store.writer_open import index_paths

    done: dict[str, str] = {}
    for p in index_paths(vdir):
        t = pq.read_table(p, columns=["key", "source"])
        done.update(zip(t.column("source").to_pylist(), t.column("key").to_pylist()))
    return done


def _read_only(vdir: Path) -> dict[str, str]:
    """The indexes read as both structures read them, nothing kept: the floor of their resident set."""
    from stages.resize.resumed_sources import _index_columns

    for _ in _index_columns(vdir):
        pass
    return {}


def measure(kind: str, vdir: Path, samples: int) -> dict:
    importlib.import_module("pyarrow.parquet")  # before the baseline: its libraries are no part of the map
    from stages.resize.resumed_sources import resumed_sources

    build = {"dict": _old_dict, "arrays": resumed_sources, "read": _read_only}[kind]
    before = _rss_mb()
    t0 = time.perf_counter()
    done = build(vdir)
    seconds = time.perf_counter() - t0
    rss_held, rss_peak = _rss_mb() - before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    t0 = time.perf_counter()
    if kind != "read":
        found = sum(done.get(_source(i)) == _key(i) for i in range(samples))
        assert found == samples and done.get("not/a/source.png") is None
    lookups = time.perf_counter() - t0
    del done
    tracemalloc.start()  # Python objects and numpy buffers; pyarrow's pool is not traced (per index, both alike)
    done = build(vdir)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"structure": kind, "samples": len(done), "held_mb": round(held / 2**20, 1),
            "build_peak_mb": round(peak / 2**20, 1), "held_mb_per_million": round(held / 2**20 * 1e6 / samples),
            "rss_held_mb": round(rss_held, 1), "rss_peak_mb": round(rss_peak, 1), "build_s": round(seconds, 2),
            "lookups_s": round(lookups, 2)}


def _source(i: int) -> str:
    return f"/data/datasets/edit-pairs-2026/target/pair_{i:08d}.jpg"


def _key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()[:32]


def write_indexes(vdir: Path, samples: int, per_shard: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for n, a in enumerate(range(0, samples, per_shard)):
        ids = range(a, min(a + per_shard, samples))
        pq.write_table(pa.table({"key": [_key(i) for i in ids], "source": [_source(i) for i in ids]}),
                       vdir / f"shard-r00-{n:05d}.index.parquet")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=200_000)
    ap.add_argument("--per-shard", type=int, default=1000)
    ap.add_argument("--one", nargs=2, metavar=("KIND", "VDIR"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.one[0], Path(a.one[1]), a.samples)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        write_indexes(Path(tmp), a.samples, a.per_shard)
        for kind in ("read", "dict", "arrays"):  # a fresh process each: no allocator state carried over
            subprocess.run([sys.executable, __file__, "--one", kind, tmp, "--samples", str(a.samples)], check=True)


if __name__ == "__main__":
    main()
