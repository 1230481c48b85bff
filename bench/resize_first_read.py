"""Bytes read from the tars, and seconds, of a first resize-bucket run over a webdataset source: before (each
local tar hashed whole for the listing hash, then streamed) against now (stages/resize/first_read.py: hashed from
the bytes the reader streams). "before" is this code with the first-read path off (`pending_tars` returning none),
each run with a new store and an empty file-hash cache; old and new interleaved, medians printed with their ratio.

    python bench/resize_first_read.py --tars 8 --samples 16 --side 768
    python bench/resize_first_read.py --format parquet --tars 4 --samples 32 --side 768

`--format parquet`: `--tars` parquet files of `--samples` rows in row groups of `--group` rows (a target, a list
column of one control, a caption). Before: each file hashed whole, then its cells read by pyarrow, and its footer
read three times (the bar's total, the column check, the reader: this code with `pending_tars` returning none and
`remembered_footers` off); now: one sequential pass per file (stages/resize/hashed_parquet.py), one footer read.
Bytes are counted in runs whose pyarrow reads go through a counted Python file; the seconds come from separate
runs with pyarrow reading the files itself (uncounted), so the counting costs neither side time.

`--side N`: each sample an N x N noise target and control (a real dataset's images are ~MB, not the demo's ~KB),
rendered small (the render is not what is measured). The tars are in the page cache: from a cold disk or a network
file system the bytes, not the seconds here, are what a run pays for.
"""

from __future__ import annotations

import argparse
import builtins
import io
import os
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

SETTINGS = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
            "resize.multiple": 16, "resize.min_side": 16}


def make_tars(src: Path, tars: int, samples: int, side: int) -> int:
    """`tars` tars of `samples` samples (noise target + control, caption); their total bytes."""
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for t in range(tars):
        with tarfile.open(src / f"shard-{t:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
            for i in range(samples):
                for name, im in ((f"{t}_{i}.png", True), (f"{t}_{i}.control.png", True), (f"{t}_{i}.txt", False)):
                    if im:
                        buf = io.BytesIO()
                        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG",
                                                                                                  compress_level=1)
                        data = buf.getvalue()
                    else:
                        data = f"make edit {t} {i}".encode()
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(data), 0, 0o644
                    tf.addfile(info, io.BytesIO(data))
    return sum(p.stat().st_size for p in src.glob("*.tar"))


class Counted(io.RawIOBase):
    def __init__(self, raw, total: list[int]):
        self.raw, self.total = raw, total

    def readinto(self, b) -> int:
        n = self.raw.readinto(b)
        self.total[0] += n or 0
        return n

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, *a) -> int:
        return self.raw.seek(*a)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()
        super().close()


def first_run(src: Path, work: Path, before: bool) -> tuple[float, float]:
    """(bytes read from the tars, seconds) of one first run: a new store, an empty file-hash cache."""
    from pipeline.config import load_config
    from stages.resize import run_lineage, stage

    run = work / f"run{len(list(work.iterdir()))}"
    os.environ["XDG_CACHE_HOME"] = str(run / "cache")
    total = [0]
    real_open, real_bltn, real_pending = builtins.open, tarfile.bltn_open, run_lineage.pending_tars

    def counting_open(file, mode="r", buffering=-1, *a, **k):
        if isinstance(file, (str, Path)) and str(file).endswith(".tar") and str(file).startswith(str(src)) \
                and "r" in mode:
            raw = Counted(real_open(file, "rb", buffering=0), total)
            return raw if buffering == 0 else io.BufferedReader(raw)
        return real_open(file, mode, buffering, *a, **k)

    builtins.open, io.open, tarfile.bltn_open = counting_open, counting_open, counting_open
    if before:
        run_lineage.pending_tars = lambda *a: frozenset()
    try:
        started = time.perf_counter()
        stage.run(load_config(None, SETTINGS), src, run / "store")
        return float(total[0]), time.perf_counter() - started
    finally:
        builtins.open, io.open, tarfile.bltn_open, run_lineage.pending_tars = real_open, real_open, real_bltn, real_pending


def make_parquet(src: Path, files: int, rows: int, side: int, group: int) -> int:
    """`files` parquet files of `rows` rows (noise target, a list of one noise control, a caption); total bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src.mkdir(parents=True)
    rng = np.random.default_rng(0)

    def png() -> bytes:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG", compress_level=1)
        return buf.getvalue()
    for f in range(files):
        pq.write_table(pa.table({"target": pa.array([png() for _ in range(rows)], pa.binary()),
                                 "controls": pa.array([[png()] for _ in range(rows)], pa.list_(pa.binary())),
                                 "caption": [f"make edit {f} {i}" for i in range(rows)]}),
                       src / f"train-{f:05d}-of-{files:05d}.parquet", row_group_size=group)
    return sum(p.stat().st_size for p in src.glob("*.parquet"))


def parquet_first_run(src: Path, work: Path, before: bool, counted: bool) -> tuple[float, float]:
    """(bytes read from the parquet files, seconds) of one first run: a new store, an empty file-hash cache."""
    import contextlib

    from pipeline.config import load_config
    from stages.resize import parquet_source, run_lineage, stage

    run = work / f"run{len(list(work.iterdir()))}"
    os.environ["XDG_CACHE_HOME"] = str(run / "cache")
    total = [0]
    real = builtins.open, parquet_source._open, run_lineage.pending_tars, stage.remembered_footers

    def counting_open(file, mode="r", buffering=-1, *a, **k):
        if isinstance(file, (str, Path)) and str(file).endswith(".parquet") and str(file).startswith(str(src)) \
                and "r" in mode:
            raw = Counted(real[0](file, "rb", buffering=0), total)
            return raw if buffering == 0 else io.BufferedReader(raw)
        return real[0](file, mode, buffering, *a, **k)

    if counted:  # Python's open (the hash pass, hashed_parquet's pass) and pyarrow's own reads, as a Python file
        builtins.open = io.open = counting_open
        parquet_source._open = lambda p: counting_open(p, "rb", buffering=0)
    if before:
        run_lineage.pending_tars = lambda *a: frozenset()
        stage.remembered_footers = contextlib.nullcontext
    try:
        started = time.perf_counter()
        stage.run(load_config(None, SETTINGS), src, run / "store")
        return float(total[0]), time.perf_counter() - started
    finally:
        builtins.open, parquet_source._open, run_lineage.pending_tars, stage.remembered_footers = real
        io.open = real[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=("webdataset", "parquet"), default="webdataset")
    ap.add_argument("--tars", type=int, default=8, help="tars (parquet files)")
    ap.add_argument("--samples", type=int, default=16, help="samples per tar (rows per parquet file)")
    ap.add_argument("--group", type=int, default=16, help="rows per row group (--format parquet)")
    ap.add_argument("--side", type=int, default=768, help="side of each noise image, px")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.format == "parquet":
        parquet_main(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        src, work = Path(tmp) / "src", Path(tmp) / "work"
        work.mkdir()
        size = make_tars(src, args.tars, args.samples, args.side)
        print(f"{args.tars} tars, {args.tars * args.samples} samples, {size / 1e6:.1f} MB")
        first_run(src, work, False)  # imports and the workers' first start: not measured
        runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(args.repeat):
            for before in (True, False):
                runs[before].append(first_run(src, work, before))
        for i, what in enumerate(("bytes read from the tars", "seconds")):
            old, new = (statistics.median(r[i] for r in runs[b]) for b in (True, False))
            shown = (f"{old / 1e6:.1f} MB", f"{new / 1e6:.1f} MB") if i == 0 else (f"{old:.2f} s", f"{new:.2f} s")
            print(f"{what}: before {shown[0]} ({old / size:.2f}x the tars) -> now {shown[1]} ({new / size:.2f}x); "
                  f"ratio {old / new:.2f}" if i == 0 else f"{what}: before {shown[0]} -> now {shown[1]}; "
                  f"ratio {old / new:.2f}")


def parquet_main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, work = Path(tmp) / "src", Path(tmp) / "work"
        work.mkdir()
        size = make_parquet(src, args.tars, args.samples, args.side, args.group)
        print(f"{args.tars} parquet files, {args.tars * args.samples} rows in row groups of {args.group}, "
              f"{size / 1e6:.1f} MB")
        parquet_first_run(src, work, False, False)  # imports and the workers' first start: not measured
        runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(args.repeat):
            for before in (True, False):
                bytes_read = parquet_first_run(src, work, before, counted=True)[0]
                runs[before].append((bytes_read, parquet_first_run(src, work, before, counted=False)[1]))
        old, new = (statistics.median(r[0] for r in runs[b]) for b in (True, False))
        print(f"bytes read from the parquet files: before {old / 1e6:.1f} MB ({old / size:.3f}x the files) -> now "
              f"{new / 1e6:.1f} MB ({new / size:.3f}x); ratio {old / new:.2f}")
        old, new = (statistics.median(r[1] for r in runs[b]) for b in (True, False))
        print(f"seconds (pyarrow reading the files itself): before {old:.2f} s -> now {new:.2f} s; ratio {old / new:.2f}")


if __name__ == "__main__":
    main()
