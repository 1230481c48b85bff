"""What resize-bucket's per-key bookkeeping holds in a rerun that carries every sample (val_fraction changed: the
1M-sample path): Python memory traced (tracemalloc) when `_revive` starts (every source sample judged: the triage's
dicts, the earlier version's keys and mask hashes, the known-sample offer, the listing all alive), and the peak, grouped by where it was
allocated. Extrapolate linearly to 1M samples.

    PYTHONPATH=. python bench/resize_key_memory.py --samples 100000

100k samples, this 2-core machine (first run 486 s), before (f82bb71f: the listing kept as (path, name, digest)
strings) and after (content.Listing one buffer), the same store:
  traced at _revive 178.7 MiB (1874 B a sample, 1M ~1.75 GB) -> 104.2 MiB (1092 B, 1M ~1.02 GB)
  peak 233.1 MiB (2444 B a sample) -> 158.6 MiB (1663 B)
  left: the listing's bytes 301 B, the folder scan's names 219 B, source names 107 B, the earlier version's keys
  (store/reuse.py) 81 B and the carried keys' copies (known_sources.py) 81 B, known-sample digests 86 B, the
  triage's dicts (rendered_before, first_source, carry) 38 B each

A folder source of N samples (a 32x32 target and control, the same pixels; each its own caption, so its own key),
rendered once (workers 0), then rerun with val_fraction 0.1 -> 0.3 under tracemalloc. The store is kept in --dir
(reused when there).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import time
import tracemalloc
from pathlib import Path

import numpy as np
from PIL import Image

SETTINGS = {"resize.target_area": 32 * 32, "resize.control_vae_area": 32 * 32, "resize.control_vl_area": 32 * 32,
            "resize.multiple": 16, "resize.workers": 0, "resize.min_side": 16}


def make_source(root: Path, n: int) -> None:
    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(b, format="PNG")
    png = b.getvalue()
    for d in ("target", "control"):
        (root / d).mkdir(parents=True)
    for i in range(n):
        stem = f"pair_{i:07d}"
        (root / "target" / f"{stem}.png").write_bytes(png)
        (root / "control" / f"{stem}.png").write_bytes(png)
        (root / "target" / f"{stem}.txt").write_text(f"make edit number {i} to the picture")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=100000)
    ap.add_argument("--dir", default="/tmp/resize_key_memory")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()

    from pipeline.config import load_config
    from stages.resize import render_loop, stage

    work = Path(a.dir) / f"n{a.samples}"
    src, store = work / "src", work / "store"
    os.environ.setdefault("XDG_CACHE_HOME", str(work / "cache"))
    if not store.exists():
        shutil.rmtree(work, ignore_errors=True)
        make_source(src, a.samples)
        t = time.perf_counter()
        s = stage.run(load_config(None, SETTINGS), src, store)
        print(f"first run: written {s.written} in {time.perf_counter() - t:.0f} s")
    rerun = work / "rerun"
    shutil.rmtree(rerun, ignore_errors=True)
    shutil.copytree(store, rerun)

    at_carry: list[tracemalloc.Snapshot] = []
    real = render_loop._revive

    def snapped(*args, **kw):
        at_carry.append(tracemalloc.take_snapshot())
        return real(*args, **kw)

    render_loop._revive = snapped
    tracemalloc.start()
    t = time.perf_counter()
    s = stage.run(load_config(None, {**SETTINGS, "resize.val_fraction": 0.3}), src, rerun)
    seconds = time.perf_counter() - t
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    render_loop._revive = real
    assert s.written == 0 and s.reused == a.samples, s
    snap = at_carry[0].filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    total = sum(st.size for st in snap.statistics("filename"))
    print(f"rerun of {a.samples} samples ({seconds:.0f} s under tracemalloc): traced at _revive "
          f"{total / 2**20:.1f} MiB ({total / a.samples:.0f} B a sample; 1M: ~{total / a.samples * 1e6 / 2**20:.0f} "
          f"MiB); peak {peak / 2**20:.1f} MiB ({peak / a.samples:.0f} B a sample)")
    for st in snap.statistics("lineno")[:a.top]:
        frame = st.traceback[0]
        print(f"  {st.size / 2**20:7.1f} MiB {st.size / a.samples:5.0f} B/sample  "
              f"{os.path.relpath(frame.filename)}:{frame.lineno}")


if __name__ == "__main__":
    main()
