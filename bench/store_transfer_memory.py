"""Memory held by `store.remote.TRANSFERS` parallel transfers (push's uploads, pull's downloads) against a local
S3-protocol server (moto in a child process, so its copies of the objects are not counted): the peak of Python's
traced allocations (tracemalloc: every bytes buffer s3fs, botocore and aiohttp hold) while --files files of --mb
MiB each move, 16 at a time.

  up-s3fs  fsspec's put_file as store/remote.py called it before: a file under 100 MiB read whole into one PUT, a
           larger one in 50 MiB parts, 10 at once
  up       Remote.upload: 16 MiB parts, 4 at once, every upload's bytes reserved from one 128 MiB budget
  down     Remote.download: one streamed GET read in 1 MiB pieces (store/remote_download.py)
  verify   `store verify URL`'s check of one object (store/remote_verify.py): streamed, CRC32C, nothing kept

    python bench/store_transfer_memory.py --files 16 --mb 20
    python bench/store_transfer_memory.py --files 4 --mb 120
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _common import s3_bucket  # noqa: E402  (a local S3 server)


class _Bar:
    def update(self, n: int = 1) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--mb", type=float, default=20)
    args = ap.parse_args()
    with s3_bucket("bench-memory"):
        from store import remote as R

        with tempfile.TemporaryDirectory(prefix="bench-transfer-") as tmp:
            files = []
            for i in range(args.files):
                p = Path(tmp) / f"f{i}"
                p.write_bytes(os.urandom(int(args.mb * 2**20)))
                files.append(p)
            rem = R.open_remote("s3://bench-memory/x")
            from store.remote_verify import RemoteObjects

            objects = RemoteObjects(rem, {f"b/{p.name}": p.stat().st_size for p in files}, progress=False)
            cases = {
                "up-s3fs": lambda p: rem.fs.put_file(str(p), rem.path(f"a/{p.name}"), mode="create"),
                "up": lambda p: rem.upload(p, f"b/{p.name}", "00000000", _Bar()),
                "down": lambda p: rem.download(f"b/{p.name}", p.with_suffix(".down"), _Bar()),
                "verify": lambda p: objects._object("b", p.name, None, False, [], _Bar()),
            }
            total = args.files * args.mb
            for name, fn in cases.items():
                tracemalloc.start()
                for _ in R.each_at_once(fn, files):
                    pass
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                print(f"{name:8s} {args.files} x {args.mb:g} MiB ({total:g} MiB): peak {peak / 2**20:7.1f} MiB held")


if __name__ == "__main__":
    main()
