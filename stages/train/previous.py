"""Keeping the run a run folder holds when training starts afresh into it: `pipeline run all` after the tables,
the model or the train config changed, and `pipeline run train --new-run`.

RUN is renamed to `RUN.previous/<N>-<UTC time of its last checkpoint>` (N = 1, 2, ... in the order kept) and an
empty RUN is made for the new run. One rename is the whole move, so a kill leaves either RUN as it was or the
kept folder complete (and RUN missing, which the rerun creates): nothing is lost at any point. The kept folder
sits beside RUN, not inside it, because moving a folder into its own subfolder takes one rename per entry (and a
recovery step for a kill between them); beside it, RUN stays exactly one run (TensorBoard, `lora merge`, ...).

Taking one back (`take_back`, `pipeline run all` when a kept run is the finished run of the present settings and
inputs, or with none such, one they resume while RUN holds none): RUN is renamed away first (kept as above when it
holds a trained run; else into `RUN.previous/.untrained-*`, removed after, or by the next take-back if a kill
stopped that), then the kept run is renamed to RUN. A kill between the two renames leaves RUN missing and both
runs under RUN.previous: the rerun finds the same kept run current and renames it back.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from schemas import atomic_write
from stages.train import state as train_state
from store import format as fmt

SUFFIX = ".previous"


def previous_root(run_dir: Path) -> Path:
    return run_dir.with_name(run_dir.name + SUFFIX)


def holds_trained_run(run_dir: Path) -> bool:
    """A committed checkpoint, a damaged one (a `step-N/` without resume.json) or a final LoRA: something a fresh
    start would overwrite."""
    checkpoints = run_dir / "checkpoints"
    return (train_state.latest_checkpoint(checkpoints) is not None or (run_dir / "lora").is_dir()
            or bool(train_state.unrecorded_checkpoints(checkpoints)))


def _next_number(root: Path) -> int:
    numbers = [int(p.name.split("-")[0]) for p in root.iterdir() if p.name.split("-")[0].isdigit()]
    return max(numbers, default=0) + 1


def kept_runs(run_dir: Path) -> list[Path]:
    """The runs kept in `RUN.previous/`, newest first (by N)."""
    root = previous_root(Path(run_dir))
    if not root.is_dir():
        return []
    kept = [p for p in root.iterdir() if p.is_dir() and p.name.split("-")[0].isdigit()]
    return sorted(kept, key=lambda p: int(p.name.split("-")[0]), reverse=True)


def take_back(run_dir: Path, kept: Path) -> Path | None:
    """Rename the kept run `kept` back to `run_dir`; the run `run_dir` holds goes first, kept (`keep`'s rename,
    returned) when it holds a trained run, else removed (returns None). The caller holds the run folder's lock."""
    run_dir = Path(run_dir)
    root = previous_root(run_dir)
    for left in root.glob(".untrained-*"):  # a kill during an earlier take-back's removal; the lock says none is live
        shutil.rmtree(left, ignore_errors=True)
    moved = None
    if run_dir.exists():
        if holds_trained_run(run_dir):
            moved = keep(run_dir)  # its one rename; it makes an empty RUN again, which the next rename replaces
            run_dir.rmdir()
        else:  # a start killed before its first checkpoint (or a lock's empty folder): nothing to keep
            aside = root / f".untrained-{os.getpid()}-{time.time_ns()}"
            os.rename(run_dir, aside)
            shutil.rmtree(aside, ignore_errors=True)
    fmt.crash_point("take_back_between_renames")
    try:
        os.rename(kept, run_dir)  # the commit: the finished run is RUN again
    except OSError as e:  # RUN made again meanwhile: another `train` into it took its lock while it was missing
        from schemas.errors import UserError

        raise UserError(f"could not take the run kept in {kept} back into {run_dir}: {run_dir} was made again "
                        f"meanwhile ({e.strerror}; another `train` into it?); both runs are kept"
                        f"{f' ({moved} holds the one it held)' if moved is not None else ''}; rerun once that "
                        "one is done") from None
    atomic_write.fsync_dir(root)
    atomic_write.fsync_dir(run_dir.parent)
    return moved


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
    atomic_write.fsync_dir(root)
    atomic_write.fsync_dir(run_dir.parent)
    fmt.crash_point("keep_after_rename")
    run_dir.mkdir()
    return dest
