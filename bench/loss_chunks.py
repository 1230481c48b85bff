"""What checking every chunk file of a loss array costs (store/loss_chunks.py): a REPORT/losses.zarr of --steps
checkpoints over --samples val samples x 2 seeds x 4 σ x 3 regions, built once (one chunk per step, as evaluate
appends them), then read in the same run (best of --repeat, interleaved):
  old   `open_dataset` of the group marked format 1 (no chunk looked at; the release before)
  new   `open_dataset` of the same group as format 2 (one stat per chunk inside the committed shapes)
and the chunk files, their bytes, and the bytes a chunk that is all fill value now takes (an all-NaN checkpoint's
row, a validation's empty sha), which zarr wrote no file for before.

    python bench/loss_chunks.py --steps 5000 --samples 64 --dir /tmp/lossbench
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from store.loss_array import GROUP, Axes, LossStore, open_dataset  # noqa: E402
from store.loss_chunks import WRITE  # noqa: E402


def build(folder: Path, steps: int, samples: int) -> Path:
    """The group with `steps` rows, written in one call (appending 5000 rows one commit at a time takes minutes of
    fsyncs; the files are the same: one chunk per step in loss, step, checkpoint, lora_sha256)."""
    import zarr

    axes = Axes([f"k{i}" for i in range(samples)], ["32x32"] * samples, [0, 1], [0.1, 0.3, 0.6, 0.9])
    s = LossStore(folder, "bench", axes, {})
    s.write_base(np.random.default_rng(0).random(axes.shape))
    g = s.group
    for name, values in (("loss", np.random.default_rng(1).random((steps, *axes.shape)).astype("float32")),
                         ("step", np.arange(1, steps + 1, dtype="int64")),
                         ("checkpoint", np.array([f"RUN/checkpoints/step-{i}/lora" for i in range(steps)], dtype=object)),
                         ("lora_sha256", np.array([f"{i:064x}" for i in range(steps)], dtype=object))):
        arr = g[name].with_config(WRITE)
        arr.resize((steps, *arr.shape[1:]))
        arr[...] = values
    zarr.consolidate_metadata(folder / GROUP)
    return folder / GROUP


def mark(group: Path, fmt: int) -> None:
    record = group / "zarr.json"
    meta = json.loads(record.read_text())
    meta["attributes"]["format"] = fmt
    record.write_text(json.dumps(meta))


def fill_chunk_bytes(folder: Path, samples: int) -> tuple[int, int]:
    """Bytes of an all-NaN loss row's chunk file and of an empty sha's (validation while training records "")."""
    axes = Axes([f"k{i}" for i in range(samples)], ["32x32"] * samples, [0, 1], [0.1, 0.3, 0.6, 0.9])
    s = LossStore(folder, "fill", axes, {})
    s.append(1, "training step 1", "", np.full(axes.shape, np.nan))
    return ((folder / GROUP / "loss" / "c" / "0" / "0" / "0" / "0" / "0").stat().st_size,
            (folder / GROUP / "lora_sha256" / "c" / "0").stat().st_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, required=True)
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    t = time.perf_counter()
    group = build(a.dir / "report", a.steps, a.samples)
    files = [p for p in group.rglob("*") if p.is_file() and p.name != "zarr.json"]
    print(f"built {a.steps} steps x {a.samples} samples in {time.perf_counter() - t:.1f} s: {len(files)} chunk files, "
          f"{sum(p.stat().st_size for p in files) / 1e6:.1f} MB")
    best = {"old": float("inf"), "new": float("inf")}
    for _ in range(a.repeat):
        for name, fmt in (("old", 1), ("new", 2)):
            mark(group, fmt)
            t = time.perf_counter()
            ds = open_dataset(group)
            best[name] = min(best[name], time.perf_counter() - t)
            assert ds.sizes["step"] == a.steps
    nan_row, empty_sha = fill_chunk_bytes(a.dir / "fill", a.samples)
    print(f"open_dataset (load): old {best['old']:.3f} s, new {best['new']:.3f} s, "
          f"{best['new'] / best['old']:.2f}x (+{(best['new'] - best['old']) * 1e3:.0f} ms for {len(files)} stats)")
    print(f"a chunk that is all fill value, now written: all-NaN loss row {nan_row} B, empty sha {empty_sha} B")
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
