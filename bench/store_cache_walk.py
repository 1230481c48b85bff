"""The store cache's walk (store/remote_cache.make_room), which runs under the node's cache lock before every
whole-shard fetch from a store URL, on a lazily cached version shaped like a 1M-sample table: --indexes shard
indexes (its metadata) and --cached shard files in the cache, each with its range count file. Baseline, measured
in the same run: a walk that stats every file through pathlib (what make_room did before it took the metadata's
sizes from the version's checksums.json). Also make_room now: far from the limit it adds to the node's running
total (`.cache.usage`) and walks nothing. Best of --repeats, interleaved.

    python bench/store_cache_walk.py --indexes 20000 --cached 2000
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(cache: Path, indexes: int, cached: int) -> None:
    from store import format as fmt
    from store.checksum import seal
    from store.integrity import CHECKSUMS_FORMAT
    from store.remote_shards import MARKER, RANGED

    root = cache / "0123456789abcdef"
    vdir = fmt.version_dir(root, "vae", 1)
    vdir.mkdir(parents=True)
    fmt.atomic_write_json(root / fmt.STORE_JSON, {"format": 1, "tables": {"vae": {"current": 1}}})
    files = {}
    for i in range(indexes):
        name = fmt.index_name(fmt.shard_name(0, i))
        (vdir / name).write_bytes(b"i" * 2000)
        files[name] = {"nbytes": 2000, "crc32c": "00000000"}
        files[fmt.shard_name(0, i)] = {"nbytes": 4096, "crc32c": "00000000"}
    for name in (fmt.MANIFEST, fmt.SCHEMA_JSON):
        (vdir / name).write_bytes(b"m" * 1000)
        files[name] = {"nbytes": 1000, "crc32c": "00000000"}
    (vdir / fmt.CHECKSUMS).write_bytes(seal({"format": CHECKSUMS_FORMAT, "files": files}))
    (vdir / MARKER).write_text('{"url": "s3://b/s", "table": "vae", "version": 1}')
    for i in range(cached):
        with open(vdir / fmt.shard_name(0, i), "wb") as f:
            f.truncate(4096)
        (vdir / f".{fmt.shard_name(0, i)}{RANGED}").write_bytes(b"r" * 64)


def stat_every_file(cache: Path) -> int:
    return sum(st.st_size for p in cache.rglob("*") if stat.S_ISREG((st := p.stat()).st_mode))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--indexes", type=int, default=20000)
    ap.add_argument("--cached", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from store.remote_cache import _evict, make_room

    work = Path(tempfile.mkdtemp(prefix="cache-walk-bench-"))
    try:
        cache = work / "cache"
        build(cache, args.indexes, args.cached)
        make_room(cache, 10**15, 1)  # the first walk reads checksums.json once per process
        best = {"stat every file": float("inf"), "walk": float("inf"), "make_room": float("inf")}
        for _ in range(args.repeats):
            t = time.perf_counter()
            stat_every_file(cache)
            best["stat every file"] = min(best["stat every file"], time.perf_counter() - t)
            t = time.perf_counter()
            _evict(cache, 10**15, set(), whole_versions=False)
            best["walk"] = min(best["walk"], time.perf_counter() - t)
            t = time.perf_counter()
            assert make_room(cache, 10**15, 1)
            best["make_room"] = min(best["make_room"], time.perf_counter() - t)
        n = sum(1 for _ in os.scandir(next(cache.glob("*/vae/v1"))))
        print(f"== cache walk: one lazily cached version, {n} files ({args.indexes} shard indexes, {args.cached} "
              f"cached shards + their range counts); best of {args.repeats}")
        for name, secs in best.items():
            print(f"{name:16s} {secs * 1e3:8.1f} ms  ({best['stat every file'] / secs:.2f}x the baseline)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
