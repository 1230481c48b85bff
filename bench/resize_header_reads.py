"""What the rerun of a store rendered by resize-bucket revision 3 reads of its source: revision 4's fix (a PNG's
one transparent colour taken as alpha; stages/resize/header_checks.py) must read each sample's pictures' headers,
as no stored column tells such a picture. Before, every picture was read whole for its header; since, a bounded
prefix of each (64 KiB, more only for a longer header).

    python bench/resize_header_reads.py --samples 60 --side 700 --controls 2
    python bench/resize_header_reads.py --format webdataset --samples 60 --side 700 --controls 2

Each picture is an N x N noise PNG (700: ~1.5 MB, a real dataset's), one sample in ten with a transparent colour in
its last control (rendered again); rendered small (the render is not what is measured). Bytes read are the process's
`rchar` (every read(2) of the rerun: the source's files and tars, the store's metadata) and the source's alone.
Files are in the page cache: a cold disk or a network file system widens the gap.

`--picture webp`: each picture a lossless WebP of the same noise (none has a transparent colour: all carried).
Pillow reads a WebP whole to open it, so its header was read whole; since, from the RIFF header's first chunk
(header_checks.webp_canvas). Measured in one run, before (this code with webp_canvas off) and now.

    python bench/resize_header_reads.py --picture webp --samples 60 --side 700 --controls 2
"""

from __future__ import annotations

import argparse
import io
import tarfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

SETTINGS = {"resize.target_area": 128 * 128, "resize.control_vae_area": 128 * 128, "resize.control_vl_area": 64 * 64,
            "resize.multiple": 16, "resize.workers": 0}


def _png(side: int, seed: int, keyed: bool = False) -> bytes:
    arr = np.random.default_rng(seed).integers(1, 255, (side, side, 3), dtype=np.uint8)
    b = io.BytesIO()
    if keyed:
        arr[:, : side // 3] = 0
        Image.fromarray(arr).save(b, format="PNG", transparency=(0, 0, 0), compress_level=1)
    else:
        Image.fromarray(arr).save(b, format="PNG", compress_level=1)
    return b.getvalue()


def _webp(side: int, seed: int) -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(1, 255, (side, side, 3), dtype=np.uint8)).save(
        b, format="WEBP", lossless=True, method=0)
    return b.getvalue()


def _samples(n: int, side: int, controls: int, picture: str = "png"):
    for i in range(n):
        pictures = [_webp(side, i * 10 + c) if picture == "webp" else
                    _png(side, i * 10 + c, keyed=(c == controls and i % 10 == 0)) for c in range(controls + 1)]
        yield f"s{i:05d}", pictures, f"edit {i}".encode()


def make_source(root: Path, fmt: str, n: int, side: int, controls: int, picture: str = "png") -> int:
    """The source; returns its bytes."""
    total = 0
    if fmt == "folder":
        for i in range(controls + 1):
            (root / ("target" if i == 0 else "control" if i == 1 else f"control_{i - 1}")).mkdir(parents=True)
        for stem, pictures, caption in _samples(n, side, controls, picture):
            for i, data in enumerate(pictures):
                folder = "target" if i == 0 else "control" if i == 1 else f"control_{i - 1}"
                (root / folder / f"{stem}.{picture}").write_bytes(data)
                total += len(data)
            (root / "target" / f"{stem}.txt").write_bytes(caption)
        return total
    root.mkdir(parents=True)
    with tarfile.open(root / "shard-000.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
        for stem, pictures, caption in _samples(n, side, controls, picture):
            exts = [picture, *((f"control.{picture}" if i == 0 else f"control_{i}.{picture}") for i in range(controls))]
            for ext, data in [*zip(exts, pictures), ("txt", caption)]:
                info = tarfile.TarInfo(f"{stem}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
                total += len(data)
    return total


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="folder", choices=("folder", "webdataset"))
    ap.add_argument("--samples", type=int, default=60)
    ap.add_argument("--side", type=int, default=700)
    ap.add_argument("--controls", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/resize_header_reads")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--picture", default="png", choices=("png", "webp"))
    a = ap.parse_args()

    from features import decode
    from pipeline.config import load_config
    from stages.resize import images_table, stage

    work = Path(a.dir)
    src, store = work / "src", work / "store"
    if not src.exists():
        size = make_source(src, a.format, a.samples, a.side, a.controls, a.picture)
        print(f"source: {a.samples} samples x {a.controls + 1} pictures, {size / 2**20:.1f} MiB")
    cfg = load_config(None, SETTINGS)
    fixes, keyed = images_table.FIXES, decode._colour_keyed
    images_table.FEATURE_REVISION, images_table.FIXES = 3, tuple(f for f in fixes if f[0] < 3)
    decode._colour_keyed = lambda im: None  # revision 3's decode
    if not store.exists():
        stage.run(cfg, src, store)
    images_table.FEATURE_REVISION, images_table.FIXES, decode._colour_keyed = 4, fixes, keyed
    from stages.resize import header_checks

    real_canvas = header_checks.webp_canvas
    for label, canvas in ((("before (webp_canvas off)", lambda head: None),) if a.picture == "webp" else ()) + \
            (("now", real_canvas),):
        header_checks.webp_canvas = canvas
        seconds, read, s = _reruns(cfg, src, store, work / "rerun", a.repeat, stage)
        print(f"{label}: rerun at revision 4: written {s.written}, reused {s.reused}; read {read / 2**20:.1f} MiB "
              f"(rchar) in {seconds:.2f} s (median of {a.repeat})")
    header_checks.webp_canvas = real_canvas


def _reruns(cfg, src: Path, store: Path, rerun: Path, repeat: int, stage) -> tuple[float, int, object]:
    import shutil

    times = []
    for _ in range(repeat + 1):  # the first imports what the stage imports lazily (webdataset: torch): not timed
        shutil.rmtree(rerun, ignore_errors=True)
        shutil.copytree(store, rerun)
        read, t = _rchar(), time.perf_counter()
        s = stage.run(cfg, src, rerun)
        times.append((time.perf_counter() - t, _rchar() - read))
    seconds, read = sorted(times[1:])[len(times[1:]) // 2]
    return seconds, read, s


if __name__ == "__main__":
    main()
