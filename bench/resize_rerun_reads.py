"""What a resize-bucket rerun with only `val_fraction` changed reads from a folder source: before (every sample's
bytes read and its key hashed again, only the rendering skipped) against now (stages/resize/known_sources.py:
samples the newest version holds with unchanged files carried by their recorded key, captions alone read),
measured in the same run on copies of the same store. "before" is this code with the known-sample lookup off.

    python bench/resize_rerun_reads.py --samples 300 --side 512

`--side N`: each target replaced by an N x N noise PNG (the demo's own images are ~1 KB; a real dataset's ~MB),
rendered small (the render is not what is measured). Files are in the page cache: a cold disk widens the gap.
"""

from __future__ import annotations

import argparse
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
    from stages.resize import known_sources, sources, stage
    from stages.resize.resumed_sources import ResumedSources

    read, keys = [0], [0]
    real_read, real_key, real_known = sources.read_source_file, stage.sample_key, known_sources.known_sources

    def counted_read(*a):
        data = real_read(*a)
        read[0] += len(data)
        return data

    def counted_key(*a):
        keys[0] += 1
        return real_key(*a)

    sources.read_source_file, stage.sample_key = counted_read, counted_key
    if before:  # nothing offered: every sample read and keyed, as before
        known_sources.known_sources = lambda st, rb, hashes, mb: known_sources.KnownSources(ResumedSources([]), hashes, mb)
    try:
        t = time.perf_counter()
        s = stage.run(load_config(None, {**SETTINGS, "resize.val_fraction": 0.3}), src, store)
        assert s.written == 0 and s.reused > 0, s
        return read[0], keys[0], time.perf_counter() - t
    finally:
        sources.read_source_file, stage.sample_key, known_sources.known_sources = real_read, real_key, real_known


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--side", type=int, default=512)
    args = ap.parse_args()
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
