"""`store verify`'s header checks of intact shards (store/verify.py `_Pread`): how many reads of the shard files
they make, and their time. Each row of a shard that matched its writer's CRC32C is checked against its sample's
headers only (each tar member's header, the safetensors member's length and JSON header): the old way read each
header on its own (5 reads for a sample of 3 members: a round trip each on a network file system), the new reads
HEADER_READ bytes at once (1 read for a small sample, 2 where the tensors' bytes lie between its headers).

Writes a vae-like version (bench/verify_cold_headers.py `build`: --samples samples of ~--kb KB, one bf16 tensor and
one small file) and verifies it both ways in the same run (best of --repeat, page cache warm: the reads' count is
the figure a network file system multiplies by its round trip), after checking both give no problem lines.

    python bench/verify_header_reads.py [--samples 3000] [--kb 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one

from store import verify  # noqa: E402
from verify_cold_headers import build  # noqa: E402


class OldPread:
    """The old `_Pread`: each slice its own read."""

    def __init__(self, fd: int, start: int, n: int) -> None:
        self.fd, self.start, self.n = fd, start, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, part: slice) -> bytes:
        a, b, _ = part.indices(self.n)
        return os.pread(self.fd, max(0, b - a), self.start + a)


def run(vdir: Path, pread_class: type) -> tuple[float, int]:
    """(seconds, reads of the shards) of one verify with `pread_class` as the header reader."""
    reads, real, kept = [0], os.pread, verify._Pread

    def counted(fd: int, n: int, at: int) -> bytes:
        reads[0] += 1
        return real(fd, n, at)

    verify._Pread, os.pread = pread_class, counted
    try:
        t0 = time.perf_counter()
        problems = verify.verify_version(vdir, "vae/v1", progress=False)
        took = time.perf_counter() - t0
    finally:
        verify._Pread, os.pread = kept, real
    assert problems == [], problems[:3]
    return took, reads[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--kb", type=int, default=64)
    ap.add_argument("--shard-mb", type=float, default=8.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-verify-cold")
    args = ap.parse_args()
    vdir = build(args.dir / f"n{args.samples}-kb{args.kb}", args.samples, args.kb, args.shard_mb)
    print(f"{args.samples} samples of ~{args.kb} KB")
    best: dict[str, tuple[float, int]] = {}
    for _ in range(args.repeat):
        for label, how in (("old", OldPread), ("new", verify._Pread)):
            secs, reads = run(vdir, how)
            if label not in best or secs < best[label][0]:
                best[label] = (secs, reads)
    for label, (secs, reads) in best.items():
        print(f"{label}: {secs:6.2f} s, {reads} reads of the shards ({reads / args.samples:.1f} a sample)")
    print(f"old / new: {best['old'][1] / best['new'][1]:.1f}x reads, {best['old'][0] / best['new'][0]:.2f}x time")


if __name__ == "__main__":
    main()
