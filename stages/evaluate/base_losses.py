"""Single-LoRA evaluate: the base's held-out loss grid (LoRA off) kept in OUT/base-losses.safetensors and reused
by a rerun whose every input of it is unchanged (`stages.evaluate.base_images.losses_key` over all the val
samples: another release's source digest is another key, recomputed). A rerun with a retrained LoRA, or another
scale, then runs the LoRA's loss pass only: the base pass cost as much (one forward per sample x seed x σ).
--all-checkpoints keeps its base losses in its loss array, and takes them from this file (`agreed_reuse`) when its
array has none (a new array: `run all` trained afresh, the old report kept with the old run and its base caches
linked into the new report folder; another checkpoint run into the same folder), and writes the file when it
computes them: one cache, one key, for both.

The file is safetensors (numbers only) with the key and the numbers' sha256 in its metadata, written atomically;
one that cannot be read, holds another key or shape, or numbers that are not the recorded ones (a flipped bit
still parses) is recomputed."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import numpy as np

FILE = "base-losses.safetensors"


def cached(out: Path, key: str, shape: tuple[int, ...], compute: Callable[[], np.ndarray]) -> np.ndarray:
    """The grid recorded under `key` in OUT, else `compute()` recorded there."""
    grid = read(Path(out) / FILE, key, shape)
    if grid is not None:
        from tqdm.auto import tqdm

        tqdm.write(f"base held-out loss: unchanged inputs, reused from {Path(out) / FILE}")
        return grid
    grid = compute()
    write(Path(out) / FILE, key, grid)
    return grid


def agreed_reuse(ranks, out: Path, key: str | None, shape: tuple[int, ...]) -> tuple[bool, np.ndarray | None]:
    """--all-checkpoints: (whether the base losses recorded in OUT under `key` are reused, the grid on rank 0).
    Rank 0 alone reads the file (`key`: its own, None on the other ranks) and its answer is every rank's (one
    decision of all): another node's view of OUT cannot make a rank skip or run the base pass alone."""
    from models.collective import together

    grid = None
    with together(ranks.world, "the kept base losses"):
        if ranks.main:
            grid = read(Path(out) / FILE, key, shape)
    (reused,) = ranks.from_main([int(grid is not None)])
    if reused and ranks.main:
        from tqdm.auto import tqdm

        tqdm.write(f"base held-out loss: unchanged inputs, reused from {Path(out) / FILE}")
    return bool(reused), grid


def read(path: Path, key: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """The grid when it is recorded under `key`, its shape and dtype are these and its numbers are the recorded
    ones; else None."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("key") != key:
                return None
            grid = f.get_tensor("base")
    except Exception:  # noqa: BLE001 - missing, truncated or foreign file: recomputed
        return None
    if grid.shape != shape or grid.dtype != np.float64 or meta.get("sha256") != _digest(grid):
        return None
    return grid


def write(path: Path, key: str, grid: np.ndarray) -> None:
    from safetensors.numpy import save

    from store.format import atomic_write_bytes
    from store.io_errors import writing

    with writing("the base held-out losses of the evaluate report", path.parent):  # full disk: one line
        grid = np.ascontiguousarray(grid, dtype=np.float64)
        atomic_write_bytes(path, save({"base": grid}, metadata={"key": key, "sha256": _digest(grid)}))


def _digest(grid: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(grid, dtype=np.float64).tobytes()).hexdigest()
