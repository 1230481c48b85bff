"""What a resize-bucket rerun with only `val_fraction` changed reads from a folder source: before (every sample's
bytes read and its key hashed again, only the rendering skipped) against now (stages/resize/known_sources.py:
samples the newest version holds with unchanged files carried by their recorded key, captions alone read),
measured in the same run on copies of the same store. "before" is this code with the known-sample lookup off.

    python bench/resize_rerun_reads.py --samples 300 --side 512
    python bench/resize_rerun_reads.py --format webdataset --samples 320 --side 512

`--side N`: each target replaced by an N x N noise PNG (the demo's own images are ~1 KB; a real dataset's ~MB),
rendered small (the render is not what is measured). Files are in the page cache: a cold disk widens the gap.

`--format parquet` (stages/resize/known_tars.py, parquet files by the tars' rules): bytes hashed and read by
pyarrow from the parquet files in a rerun, before (this code with the file record off: every file read whole) and
now (unchanged files: their footers only).

    python bench/resize_rerun_reads.py --format parquet --samples 400 --side 512 --files 4

`--format webdataset` (stages/resize/known_tars.py): bytes hashed (the listing hash's file_sha256) and streamed from
the tars, and tars header-walked for the bar's total, in the first run and in the rerun, before (no tar record:
this code with known_tars off) and now.
"""

from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image


SETTINGS = {"resize.target_area": 128 * 128, "resize.control_vae_area": 128 * 128, "resize.control_vl_area": 64 * 64,
            "resize.multiple": 16, "resize.workers": 1}


def rerun(src: Path, store: Path, before: bool) -> tuple[int, int, float]:
    """(source bytes read, keys hashed, seconds) of a rerun with val_fraction 0.1 -> 0.3."""
    from pipeline.config import load_config
    from stages.resize import folder_source, jsonl_source, judge, known_sources, sources, stage
    from stages.resize.resumed_sources import ResumedSources

    read, keys = [0], [0]
    real_read, real_key, real_known = sources.read_source_file, judge.sample_key, known_sources.known_sources

    def counted_read(*a):
        data = real_read(*a)
        read[0] += len(data)
        return data

    def counted_key(*a):
        keys[0] += 1
        return real_key(*a)

    folder_source.read_source_file = jsonl_source.read_source_file = counted_read
    judge.sample_key = counted_key
    if before:  # nothing offered: every sample read and keyed, as before
        known_sources.known_sources = lambda st, rb, hashes, mb: known_sources.KnownSources(ResumedSources([]), hashes, mb)
    try:
        t = time.perf_counter()
        s = stage.run(load_config(None, {**SETTINGS, "resize.val_fraction": 0.3}), src, store)
        assert s.written == 0 and s.reused > 0, s
        return read[0], keys[0], time.perf_counter() - t
    finally:
        folder_source.read_source_file = jsonl_source.read_source_file = real_read
        judge.sample_key, known_sources.known_sources = real_key, real_known


class _Counted:
    """A shard stream that counts the bytes read from it."""

    def __init__(self, f, n: list[int]) -> None:
        self._f, self._n = f, n

    def read(self, size: int = -1) -> bytes:
        data = self._f.read(size)
        self._n[0] += len(data)
        return data

    def close(self) -> None:
        self._f.close()


def tar_run(src: Path, store: Path, before: bool, val_fraction: float) -> tuple[int, int, int, float]:
    """(bytes hashed, bytes streamed from tars, tars header-walked, seconds) of one run over a webdataset source."""
    import tarfile

    from models import file_hashes
    from pipeline.config import load_config
    from stages.resize import content, known_tars, stage, webdataset_source

    hashed, streamed, walked = [0], [0], [0]
    real = (webdataset_source.open_shard, tarfile.open, file_hashes.file_sha256, content.file_sha256, known_tars.known_tars)

    def sha(p):
        hashed[0] += Path(p).stat().st_size
        return real[2](p)

    def tar_open(name=None, *a, **kw):
        walked[0] += name is not None
        return real[1](name, *a, **kw)

    webdataset_source.open_shard = lambda url: _Counted(real[0](url), streamed)
    tarfile.open, file_hashes.file_sha256, content.file_sha256 = tar_open, sha, sha
    if before:  # no record read: every tar streamed, as before
        known_tars.known_tars = lambda st, rb, h, *a, **k: known_tars.KnownTars(h, {}, None, {})
    try:
        t = time.perf_counter()
        stage.run(load_config(None, {**SETTINGS, "resize.val_fraction": val_fraction}), src, store)
        return hashed[0], streamed[0], walked[0], time.perf_counter() - t
    finally:
        (webdataset_source.open_shard, tarfile.open, file_hashes.file_sha256, content.file_sha256,
         known_tars.known_tars) = real


def tar_main(samples: int, side: int) -> None:
    import io
    import os
    import tarfile

    from pipeline.demo_data import make_demo_data

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["XDG_CACHE_HOME"] = str(root / "cache")  # a cold file-hash cache: the first run hashes
        make_demo_data(root / "src", n=samples, fmt="webdataset", max_controls=2, seed=0, with_masks=True)
        rng = np.random.default_rng(0)
        for tar in sorted((root / "src").glob("*.tar")):
            with tarfile.open(tar) as tf:
                members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
            with tarfile.open(tar, "w", format=tarfile.USTAR_FORMAT) as tf:
                for m, data in members:
                    if m.name.count(".") == 1 and m.name.endswith(".png"):  # the target: noise, side x side
                        buf = io.BytesIO()
                        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG",
                                                                                                 compress_level=1)
                        data = buf.getvalue()
                        m.size = len(data)
                    tf.addfile(m, io.BytesIO(data))
        total = sum(t.stat().st_size for t in (root / "src").glob("*.tar"))
        first = {}
        for name in ("before", "now"):
            (root / "cache").exists() and shutil.rmtree(root / "cache")
            first[name] = tar_run(root / "src", root / f"store-{name}", name == "before", 0.1)
        again = {name: tar_run(root / "src", root / f"store-{name}", name == "before", 0.3)
                 for name in ("before", "now")}
        n_tars = len(list((root / "src").glob("*.tar")))
    mib = 2 ** 20
    print(f"{samples} samples in {n_tars} tars, {total / mib:.1f} MiB (webdataset)")
    for what, runs in (("first run (cold hash cache)", first), ("rerun, val_fraction 0.1 -> 0.3", again)):
        print(what + ":")
        for name, (h, s, w, sec) in runs.items():
            print(f"  {name:6s} hashed {h / mib:7.2f} MiB, streamed {s / mib:7.2f} MiB, {w:3d} tars header-walked, "
                  f"{sec:6.2f} s")
    b, n = again["before"], again["now"]
    print(f"  rerun bytes read: {(b[0] + b[1]) / mib:.2f} MiB before, {(n[0] + n[1]) / mib:.2f} MiB now; "
          f"time {b[3] / n[3]:.2f}x")


def parquet_run(src: Path, store: Path, before: bool) -> tuple[int, int, float]:
    """(bytes hashed, bytes pyarrow read from the parquet files, seconds) of a rerun with val_fraction 0.1 -> 0.3."""
    import builtins

    from models import file_hashes
    from pipeline.config import load_config
    from stages.resize import content, known_tars, parquet_source, stage

    hashed, read = [0], [0]
    real = (parquet_source._open, file_hashes.file_sha256, content.file_sha256, known_tars.known_tars)

    def sha(p):
        hashed[0] += Path(p).stat().st_size
        return real[1](p)

    class Counted(io.RawIOBase):  # pyarrow reads a Python file through readinto/seek
        def __init__(self, path):
            self.f = builtins.open(path, "rb", buffering=0)

        def readinto(self, b):
            n = self.f.readinto(b)
            read[0] += n or 0
            return n

        def readable(self):
            return True

        def seekable(self):
            return True

        def seek(self, *a):
            return self.f.seek(*a)

        def tell(self):
            return self.f.tell()

        def close(self):
            self.f.close()
            super().close()

    parquet_source._open = lambda p: Counted(p)
    file_hashes.file_sha256, content.file_sha256 = sha, sha
    if before:  # no record read: every file read whole, as before
        known_tars.known_tars = lambda st, rb, h, mb, kind=known_tars.Kind(): \
            known_tars.KnownTars(h, {}, None, {}, kind)
    try:
        t = time.perf_counter()
        s = stage.run(load_config(None, {**SETTINGS, "resize.val_fraction": 0.3}), src, store)
        assert s.written == 0 and s.reused > 0, s
        return hashed[0], read[0], time.perf_counter() - t
    finally:
        parquet_source._open, file_hashes.file_sha256, content.file_sha256, known_tars.known_tars = real


def parquet_main(samples: int, side: int, files: int) -> None:
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.config import load_config
    from stages.resize import stage

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["XDG_CACHE_HOME"] = str(root / "cache")
        (root / "src").mkdir()
        rng = np.random.default_rng(0)
        per = -(-samples // files)
        for i in range(files):
            targets = []
            for _ in range(per):
                buf = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG",
                                                                                         compress_level=1)
                targets.append(buf.getvalue())
            pq.write_table(pa.table({"target": pa.array(targets, pa.binary()),
                                     "controls": pa.array([[] for _ in range(per)], pa.list_(pa.binary())),
                                     "caption": [f"make edit {i} {j}" for j in range(per)]}),
                           root / "src" / f"train-{i:05d}.parquet", row_group_size=100)
        stage.run(load_config(None, {**SETTINGS, "resize.val_fraction": 0.1}), root / "src", root / "store")
        shutil.copytree(root / "store", root / "store-before")
        shutil.copytree(root / "store", root / "store-now")
        total = sum(f.stat().st_size for f in (root / "src").glob("*.parquet"))
        old = parquet_run(root / "src", root / "store-before", before=True)
        new = parquet_run(root / "src", root / "store-now", before=False)
    mib = 2 ** 20
    print(f"{files * per} samples in {files} parquet files, {total / mib:.1f} MiB; rerun with val_fraction 0.1 -> 0.3:")
    for name, (h, r, sec) in (("before", old), ("now", new)):
        print(f"  {name:6s} hashed {h / mib:7.2f} MiB, read by pyarrow {r / mib:8.2f} MiB, {sec:6.2f} s")
    print(f"  bytes read: {(old[0] + old[1]) / max(new[0] + new[1], 1):.0f}x fewer; time: {old[2] / new[2]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--side", type=int, default=512)
    ap.add_argument("--format", choices=("folder", "webdataset", "parquet"), default="folder")
    ap.add_argument("--files", type=int, default=4, help="parquet files (--format parquet)")
    args = ap.parse_args()
    if args.format == "webdataset":
        tar_main(args.samples, args.side)
        return
    if args.format == "parquet":
        parquet_main(args.samples, args.side, args.files)
        return
    from pipeline.config import load_config
    from pipeline.demo_data import make_demo_data
    from stages.resize import stage

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_demo_data(root / "src", n=args.samples, fmt="folder", max_controls=2, seed=0, with_masks=True)
        rng = np.random.default_rng(0)
        for f in sorted((root / "src" / "target").glob("*.png")):
            Image.fromarray(rng.integers(0, 256, (args.side, args.side, 3), dtype=np.uint8)).save(f, compress_level=1)
        stage.run(load_config(None, {**SETTINGS, "resize.val_fraction": 0.1}), root / "src", root / "store")
        shutil.copytree(root / "store", root / "store-before")
        shutil.copytree(root / "store", root / "store-now")
        total = sum(f.stat().st_size for f in (root / "src").rglob("*") if f.is_file())
        old = rerun(root / "src", root / "store-before", before=True)
        new = rerun(root / "src", root / "store-now", before=False)
    print(f"{args.samples} samples, source {total / 2**20:.1f} MiB; rerun with val_fraction 0.1 -> 0.3:")
    for name, (b, k, s) in (("before", old), ("now", new)):
        print(f"  {name:6s} read {b / 2**20:8.2f} MiB ({100 * b / total:5.1f} % of the source), {k:5d} keys hashed, "
              f"{s:6.2f} s")
    print(f"  bytes read: {old[0] / max(new[0], 1):.0f}x fewer; time: {old[2] / new[2]:.2f}x")


if __name__ == "__main__":
    main()
