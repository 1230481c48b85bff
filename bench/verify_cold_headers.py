"""`store verify` of a version larger than the page cache: when are a shard's headers read back?

verify reads every file of a version for its CRC32C, then checks each manifest row against its shard's tar and
safetensors headers (a few hundred bytes a sample; store/verify.py). The old order read every file first and the
headers in a second pass: at 1M samples a version is TBs, so by then the first shards had long left the page cache
and every header was a cold read (a disk seek, or a network round trip on a shared file system: millions of them).
Now each shard's headers are checked right after its CRC, while its pages are still cached.

Writes a vae-like version of --samples samples of ~--kb KB each (one bf16 tensor, one small file; --shard-mb MB
shards) into --dir, then verifies it both ways in the same run (best of --repeat), with the page cache made to hold
only the --cached most recently checksummed files (posix_fadvise DONTNEED on the older ones and on every file of the
version before each run: what reading TBs does to it). Prints each way's wall time and the bytes it read from the
disk (/proc/self/io read_bytes), after checking both give the same problem lines (none).
2-core shared dev machine (load 4-7), ext4 on a local virtio disk, best of 3:
  defaults (3,000 samples of 64 KB, 24 shards of 8 MB, 195 MB): old 0.67-0.91 s, 217 MB read from the disk; new
  0.37-0.47 s, 195 MB (the version's bytes, once): 1.41-2.38x over 3 runs
  --samples 1500 --kb 256 --shard-mb 32 (376 MB): old 0.55 s, 387 MB; new 0.45 s, 376 MB: 1.22x
The old way's extra is a cold read per header page (readahead around it): on a local disk ~0.1 ms each, on a
network file system a round trip each, for every sample of every table (3 tables x 1M samples at scale).

    python bench/verify_cold_headers.py [--samples 3000] [--kb 64] [--shard-mb 8] [--cached 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one

from schemas import FieldSpec, Lineage, TableSchema  # noqa: E402
from store import Store  # noqa: E402
from store import integrity, verify  # noqa: E402
from store.verify_manifest import read_manifest_pass  # noqa: E402


def old_verify_version(vdir: Path, name: str) -> list[str]:
    """The former two-pass order of `verify_version` (local store, format 2), kept verbatim as the baseline: every
    file's CRC first, then every shard's rows against its headers."""
    problems: list[str] = []
    record = integrity.read_version_record(vdir)
    sums, counts = record["files"], record.get("counts")
    found, by_shard = read_manifest_pass(vdir, name, sums, counts)
    files, intact = verify._file_problems(vdir, name, sums, set(by_shard), False)
    problems += files + found
    for shard in by_shard:
        try:
            srows, bad = verify.shard_rows(by_shard[shard], name)
            problems += bad
            problems += verify._check_shard(vdir / shard, f"{name}/{shard}", srows, whole_file_checked=True,
                                            as_written=shard in intact and verify._as_written(srows, sums[shard]))
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name}/{shard}: cannot be checked ({type(e).__name__}: {e})")
    return problems


def build(root: Path, samples: int, kb: int, shard_mb: float) -> Path:
    """The version (reused when there), returned as its folder."""
    vdir = root / "vae" / "v1"
    if (vdir / "manifest.parquet").is_file():
        return vdir
    shutil.rmtree(root, ignore_errors=True)
    schema = TableSchema(name="vae", lineage=Lineage("encode-vae", config_hash="bench", upstream={"images": 1}),
                         fields=[FieldSpec("target", "bfloat16", 4), FieldSpec("target.png", "png", kind="file"),
                                 FieldSpec("split", "string", kind="column"),
                                 FieldSpec("img_shapes", "json", kind="column")])
    w = Store(root).writer("vae", schema, shard_size_mb=shard_mb)
    side = max(1, int((kb * 1024 / 2 / 16) ** 0.5))
    g = torch.Generator().manual_seed(0)
    for i in range(samples):
        key = hashlib.sha256(f"cold-{i}".encode()).hexdigest()[:32]
        w.add(key, tensors={"target": torch.randn(16, 1, side, side, generator=g).bfloat16()},
              files={"target.png": bytes(range(i % 200))}, meta={"split": "train", "img_shapes": [[1, side, side]]})
    w.commit()
    return vdir


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _disk_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def run(how: Any, vdir: Path, cached: int) -> tuple[float, int, list[str]]:
    """(seconds, bytes read from the disk, problem lines) of one verify with a page cache of `cached` files."""
    for p in vdir.iterdir():
        _evict(p)
    recent: collections.deque[Path] = collections.deque()
    crc = verify.file_crc

    def crc_then_forget(path: Path) -> tuple[str, int]:
        out = crc(path)
        recent.append(path)
        while len(recent) > cached:
            _evict(recent.popleft())
        return out

    verify.file_crc = crc_then_forget
    try:
        before, t0 = _disk_read_bytes(), time.perf_counter()
        problems = how(vdir, "vae/v1")
        return time.perf_counter() - t0, _disk_read_bytes() - before, problems
    finally:
        verify.file_crc = crc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--kb", type=int, default=64)
    ap.add_argument("--shard-mb", type=float, default=8.0)
    ap.add_argument("--cached", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-verify-cold")
    args = ap.parse_args()
    vdir = build(args.dir / f"n{args.samples}-kb{args.kb}", args.samples, args.kb, args.shard_mb)
    shards = len(list(vdir.glob("shard-*.tar")))
    size = sum(p.stat().st_size for p in vdir.iterdir())
    print(f"{args.samples} samples, {shards} shards, {size / 2**20:.0f} MB; page cache: the last {args.cached} files")
    ways = {"old": old_verify_version, "new": lambda v, n: verify.verify_version(v, n, progress=False)}
    best: dict[str, tuple[float, int]] = {}
    for _ in range(args.repeat):
        for label, how in ways.items():
            secs, nbytes, problems = run(how, vdir, args.cached)
            assert problems == [], problems[:3]
            if label not in best or secs < best[label][0]:
                best[label] = (secs, nbytes)
    for label, (secs, nbytes) in best.items():
        print(f"{label}: {secs:6.2f} s, {nbytes / 2**20:7.1f} MB read from the disk")
    print(f"old / new: {best['old'][0] / best['new'][0]:.2f}x time, "
          f"{best['old'][1] / max(1, best['new'][1]):.2f}x disk bytes")


if __name__ == "__main__":
    main()
