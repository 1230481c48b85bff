"""Keeping the run a run folder holds when training starts afresh into it: `pipeline run all` after the tables,
the model or the train config changed, and `pipeline run train --new-run`.

RUN is renamed to `RUN.previous/<N>-<UTC time of its last checkpoint>` (N = 1, 2, ... in the order kept) and an
empty RUN is made for the new run. One rename is the whole move, so a kill leaves either RUN as it was or the
kept folder complete (and RUN missing, which the rerun creates): nothing is lost at any point. The kept folder
sits beside RUN, not inside it, because moving a folder into its own subfolder takes one rename per entry (and a
recovery step for a kill between them); beside it, RUN stays exactly one run (TensorBoard, `lora merge`, ...).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from stages.train import state as train_state
from store import format as fmt

SUFFIX = ".previous"


def previous_root(run_dir: Path) -> Path:
    return run_dir.with_name(run_dir.name + SUFFIX)


def holds_trained_run(run_dir: Path) -> bool:
    """A committed checkpoint or a final LoRA: something a fresh start would overwrite."""
    return train_state.latest_checkpoint(run_dir / "checkpoints") is not None or (run_dir / "lora").is_dir()


def _next_number(root: Path) -> int:
    numbers = [int(p.name.split("-")[0]) for p in root.iterdir() if p.name.split("-")[0].isdigit()]
    return max(numbers, default=0) + 1


def keep(run_dir: Path) -> Path:
    """Move the run in `run_dir` to `RUN.previous/<N>-<time>` (one atomic rename), make `run_dir` again, empty;
    returns where the run now is. The caller holds the run folder's lock (no trainer writes it meanwhile)."""
    run_dir = Path(run_dir)
    root = previous_root(run_dir)
    root.mkdir(exist_ok=True)
    latest = train_state.latest_checkpoint(run_dir / "checkpoints")
    when = (latest / train_state.RESUME_JSON) if latest is not None else run_dir
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when.stat().st_mtime))
    dest = root / f"{_next_number(root)}-{stamp}"
    fmt.crash_point("keep_before_rename")
    os.rename(run_dir, dest)  # the commit: the old run is complete under its new name
    fmt.fsync_dir(root)
    fmt.fsync_dir(run_dir.parent)
    fmt.crash_point("keep_after_rename")
    run_dir.mkdir()
    return dest
