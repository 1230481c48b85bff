"""A table version's commit on rank 0 (store/writer_commit.commit_local) over a real store of N samples
(bench/scale_store.py builds it): merge the shard indexes into the manifest, then checksums.json. The checksums
used to read every index again for its CRC32C after the merge had read them all (at 1M samples ~6,000 files; on
a shared file system or an object store's cache, round trips); they now come from the bytes the merge parsed.

For each table's v1, in a scratch folder of hard links to its files (the store is not changed), measures in the
same run (best of --repeat, interleaved, after checking both write the same manifest and checksums.json):
  old   the former path: each index read through pq.ParquetFile(path), merged, then `write_version_checksums`
        reading every index again (kept below verbatim as the baseline)
  new   `merge_measured` (each index read once, its CRC32C from those bytes) and `write_version_checksums(...,
        measured)`
with each phase's time (reads, concat + sort, manifest bytes, checksums.json) and the bytes the process read
(/proc/self/io rchar: page-cache reads count too). Files in the page cache (they were just written).

    python bench/commit_checksums.py --samples 100000 --dir /tmp/scale

2-core dev machine shared with other jobs (load ~4-5), 100k samples (scale_store's --shard-mb 1), best of 3:
  images  590 indexes, 23.4 MB   old 1.21 s, 65.6 MB read   new 1.09 s, 23.5 MB read   1.11x time, 2.80x bytes
  text    497 indexes, 17.3 MB   old 0.87 s, 49.1 MB read   new 0.85 s, 17.3 MB read   1.03x time, 2.84x bytes
  vae     384 indexes, 16.5 MB   old 0.84 s, 47.4 MB read   new 0.81 s, 16.6 MB read   1.04x time, 2.86x bytes
(pq.ParquetFile(path) alone read each index ~1.8x: its footer, then its column chunks, separate reads; now one.)
In the page cache the second read cost little (checksums.json 0.05-0.08 s); on a shared file system each was
an open and round trips more per index. concat + sort was 0.2-0.3 s of each (the sort's indexes ~0.05 s, the
take of every column the rest; what a sorted manifest costs), the manifest's parquet bytes 0.1-0.25 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from schemas.errors import UserError  # noqa: E402
from store import format as fmt  # noqa: E402
from store.checksum import unseal  # noqa: E402
from store.integrity import write_version_checksums  # noqa: E402
from store.manifest import INDEX_READERS, read_indexes  # noqa: E402

# both sides merge alike (the reads and checksums.json are measured here): the in-memory merge of their time, as
# bench/merge_memory.py keeps it (store/manifest.py now streams the merge straight into the file)
from merge_memory import joined_merged as _merged  # noqa: E402


def old_read_indexes(paths: list[Path]) -> list[pa.Table]:
    """`read_indexes` before each index's bytes were kept for its checksum (store/manifest.py at ea60028)."""
    def read(p: Path) -> pa.Table:
        try:
            with pq.ParquetFile(p) as f:
                return f.read(use_threads=False)
        except (OSError, pa.ArrowException) as e:
            raise UserError(f"{p}: the shard index is unreadable ({e})") from None

    with ThreadPoolExecutor(min(INDEX_READERS, len(paths))) as pool:
        return list(pool.map(read, paths))


def rchar() -> int:
    """Bytes this process has read through read(2) and friends, page-cache hits included."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def commit(scratch: Path, new: bool) -> dict[str, float]:
    """One commit's merge and checksums.json in `scratch`; each phase's seconds and the MB read."""
    (scratch / fmt.CHECKSUMS).unlink(missing_ok=True)
    paths = sorted(scratch.glob("shard-r*-*.index.parquet"))
    r0, t0 = rchar(), time.perf_counter()
    if new:
        reads = read_indexes(paths)
        parts, measured = [r.rows for r in reads], {p.name: r.measured for p, r in zip(paths, reads)}
    else:
        parts, measured = old_read_indexes(paths), None
    t1 = time.perf_counter()
    manifest = _merged(parts)
    t2 = time.perf_counter()
    manifest_bytes = fmt.parquet_bytes(manifest)
    t3 = time.perf_counter()
    write_version_checksums(scratch, manifest, manifest_bytes, measured)
    t4 = time.perf_counter()
    return {"reads": t1 - t0, "merge": t2 - t1, "bytes": t3 - t2, "sums": t4 - t3, "total": t4 - t0,
            "MB": (rchar() - r0) / 1e6, "manifest": manifest_bytes}


def scratch_of(vdir: Path, base: Path) -> Path:
    """Hard links to the version's files but its manifest and checksums.json: a commit's folder, the store kept."""
    out = base / f"commit-{vdir.parent.name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for p in vdir.iterdir():
        if p.is_file() and p.name not in (fmt.MANIFEST, fmt.CHECKSUMS):
            os.link(p, out / p.name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/scale"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tables", default="images,text,vae")
    args = ap.parse_args()
    from scale_store import build

    root = build(args.dir, args.samples)
    for table in args.tables.split(","):
        scratch = scratch_of(root / table / "v1", args.dir)
        try:
            runs: dict[bool, list[dict]] = {False: [], True: []}
            sums = {}
            for _ in range(args.repeat):
                for new in (False, True):
                    runs[new].append(commit(scratch, new))
                    sums[new] = unseal((scratch / fmt.CHECKSUMS).read_bytes())
            assert runs[False][0]["manifest"] == runs[True][0]["manifest"], "the manifests differ"
            assert sums[False] == sums[True], "the checksums.json records differ"
            n = len(list(scratch.glob("shard-r*-*.index.parquet")))
            mb = sum(p.stat().st_size for p in scratch.glob("shard-r*-*.index.parquet")) / 1e6
            best = {new: {k: min(r[k] for r in runs[new]) for k in ("reads", "merge", "bytes", "sums", "total", "MB")}
                    for new in runs}
            print(f"{table}: {n} indexes, {mb:.1f} MB (best of {args.repeat})")
            for new in (False, True):
                b = best[new]
                print(f"  {'new' if new else 'old'}  {b['total']:.2f} s: reads {b['reads']:.2f}, concat+sort "
                      f"{b['merge']:.2f}, manifest bytes {b['bytes']:.2f}, checksums.json {b['sums']:.2f}; "
                      f"read {b['MB']:.1f} MB")
            print(f"  old / new: {best[False]['total'] / best[True]['total']:.2f}x time, "
                  f"{best[False]['MB'] / best[True]['MB']:.2f}x bytes read")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
