"""Each shard index read once where `store repair` rebuilds a damaged manifest and where a rank of a URL's version
lists its part (`store.remote_parts.rank_files`), against the former reads (kept below verbatim as the baseline):
  repair      old: each index read to check it against checksums.json, read again by the merge, and a third time
              by the scan's check of the files the manifest makes redundant; new: `merge_measured(..., check=)`,
              its (crc32c, nbytes) reused by that check
  rank_files  old: pq.read_schema, pq.read_table of two columns, then the file's CRC32C (three opens and reads of
              each index); new: `read_indexes(columns=)`, one read, the CRC32C of the same bytes
Index files as bench/commit_indexes.py builds them (--samples rows in --per-shard rows each, 8 ranks' shards), in
--dir (reused on reruns). Measures in the same run (best of --repeat, interleaved, after checking both give the
same result) each one's seconds and the bytes the process read (/proc/self/io rchar: page-cache reads count too).
Files in the page cache; on a shared file system each open and read is round trips more per index.

    python bench/index_reads.py --samples 100000 --per-shard 100

2-core dev machine shared with other jobs (load ~9), 1,000 indexes (14.0 MB), best of 5, page cache:
  repair      old 1.42 s, 42.1 MB read   new 1.57 s, 14.0 MB read   3.0x bytes (time: noise, see below)
  rank_files  old 1.92 s, 60.1 MB read   new 0.33 s, 14.0 MB read   5.9x time, 4.3x bytes
repair's time is the merge's (concat + sort of 100k rows, 1.0-2.0 s from run to run under this load); its check
reads and the derived files' CRCs, now gone, cost ~0.02 s each in the page cache. rank_files' old reads were
pq.read_table's dataset set-up per file and three opens of each (the kernel's count: tests/store/test_index_reads.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from commit_checksums import rchar  # noqa: E402
from commit_indexes import build  # noqa: E402
from store import format as fmt  # noqa: E402
from store import integrity  # noqa: E402
from store.checksum import file_crc  # noqa: E402
from store.manifest import merge_indexes, merge_measured  # noqa: E402
from store.remote_parts import INDEX_SUFFIX, rank_files  # noqa: E402

RANKS = 8


def old_repair(vdir: Path, paths: list[Path], sums: dict) -> tuple:
    """store/repair.py `_manifest`'s rebuild and the derived files' check before each index was read once."""
    for p in paths:
        integrity.check_bytes(vdir, p.name, p.read_bytes(), sums)
    manifest = merge_indexes(paths)
    damaged = [p.name for p in paths if file_crc(p) != (sums[p.name]["crc32c"], sums[p.name]["nbytes"])]
    return manifest, damaged


def new_repair(vdir: Path, paths: list[Path], sums: dict) -> tuple:
    manifest, measured = merge_measured(paths, check=lambda p, m: integrity.check_measured(vdir, p.name, m, sums))
    damaged = [p.name for p in paths if (measured.get(p.name) or file_crc(p)) !=
               (sums[p.name]["crc32c"], sums[p.name]["nbytes"])]
    return manifest, damaged


def old_rank_files(vdir: Path, rank: int) -> dict:
    """store/remote_parts.py `rank_files` before `read_indexes` (at b0db0d0), verbatim but for the tars' fallback."""
    files = {}
    for index in sorted(vdir.glob(f"{fmt.shard_prefix(rank)}*{INDEX_SUFFIX}")):
        shard = vdir / (index.name[: -len(INDEX_SUFFIX)] + ".tar")
        rows = pq.read_table(index, columns=[c for c in ("shard_nbytes", "shard_crc32c")
                                              if c in pq.read_schema(index).names])
        crc = rows.column("shard_crc32c")[0].as_py()
        nbytes = int(rows.column("shard_nbytes")[0].as_py())
        files[shard.name] = {"nbytes": nbytes, "crc32c": crc}
        c, n = file_crc(index)
        files[index.name] = {"nbytes": n, "crc32c": c}
    c, n = file_crc(vdir / fmt.SCHEMA_JSON)
    files[fmt.SCHEMA_JSON] = {"nbytes": n, "crc32c": c}
    return files


def measured(fn) -> tuple[float, float, object]:
    r0, t0 = rchar(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, (rchar() - r0) / 1e6, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--per-shard", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm/commit-indexes"))
    a = ap.parse_args()
    paths = build(a.dir / f"n{a.samples}-{a.per_shard}", a.samples, a.per_shard)
    vdir = paths[0].parent
    (vdir / fmt.SCHEMA_JSON).write_text("{}")  # rank_files lists it
    sums = {p.name: dict(zip(("crc32c", "nbytes"), file_crc(p))) for p in paths}
    mb = sum(p.stat().st_size for p in paths) / 1e6
    cases = {
        "repair": (lambda: old_repair(vdir, paths, sums), lambda: new_repair(vdir, paths, sums)),
        "rank_files": (lambda: [old_rank_files(vdir, r) for r in range(RANKS)],
                       lambda: [rank_files(vdir, r) for r in range(RANKS)]),
    }
    for name, (old, new) in cases.items():
        runs: dict[str, list] = {"old": [], "new": []}
        for _ in range(a.repeat):  # interleaved: a busy machine slows both alike
            runs["old"].append(measured(old))
            runs["new"].append(measured(new))
        (o_s, o_mb, o_out), (n_s, n_mb, n_out) = min(runs["old"], key=lambda r: r[0]), min(runs["new"], key=lambda r: r[0])
        if name == "repair":
            assert o_out[0].equals(n_out[0]) and o_out[1] == n_out[1] == [], "the two rebuilds disagree"
        else:
            assert o_out == n_out, "the two upload lists disagree"
        print(json.dumps({"case": name, "indexes": len(paths), "index_MB": round(mb, 1), "old_s": round(o_s, 2),
                          "old_read_MB": round(o_mb, 1), "new_s": round(n_s, 2), "new_read_MB": round(n_mb, 1),
                          "old_over_new_s": round(o_s / n_s, 2), "old_over_new_MB": round(o_mb / max(n_mb, 1e-9), 2)}))


if __name__ == "__main__":
    main()
