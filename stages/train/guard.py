"""What keeps a training run from producing or overwriting garbage: one writer per run folder (a lock naming
its holder), non-finite loss / gradient detection with the step and sample keys named, and a refusal to save a
LoRA holding non-finite values."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from schemas.errors import UserError
from store import format as fmt

LOCK_NAME = ".train.lock"
DAMAGED_REPORT = "damaged_samples.jsonl"  # stages.train.damaged_log.NAME


class NonFiniteError(UserError):
    """A non-finite loss or gradient (train.on_nonfinite=stop)."""


class RunDirLock:
    """The run folder's lock, held for the whole run: a second `train` into the same --out fails at once naming
    the holder (pid, host). The kernel drops an flock when its process dies, so a killed run never leaves a stale
    lock.

    A start that fails before writing anything into the folder (a missing table, a bad input) leaves no trace
    on `release`: the lock file goes if this start made it, and so do the folders it made (--out and any missing
    parent), when they hold nothing else. Before, the failed start left an empty --out holding its lock, which
    looked like a run. Whatever was there before this start (a user's empty folder, an earlier run's lock) stays;
    a SIGKILL cleans nothing up (the folder then holds only the lock, which the rerun takes)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._path = run_dir / LOCK_NAME
        while True:
            self._made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # deepest first
            run_dir.mkdir(parents=True, exist_ok=True)
            made_lock = not self._path.exists()
            try:
                self._lock = fmt.HeldLock(self._path, holder=f"run folder {run_dir}")
                break
            except FileNotFoundError:  # a failed start's release removed the folder just made: make it again
                if run_dir.is_dir():
                    raise
        self._inode = self._path.stat().st_ino if made_lock else None  # held: the file at the path is ours

    def release(self) -> None:
        if self._lock is None:
            return
        try:
            if self._inode is not None and self._untouched():
                # unlinked while still held: a second start whose non-blocking lock fails names this one; one that
                # locks the unlinked file after the release opens the path again (store/format.flock)
                self._path.unlink()
                for folder in self._made:
                    folder.rmdir()  # only an empty folder goes (OSError otherwise: kept)
        except OSError:
            pass  # a folder that is not empty any more, or gone: nothing of anyone else's is removed
        finally:
            self._lock.release()
            self._lock = None

    def _untouched(self) -> bool:
        """The folder holds only this start's lock file (not moved aside by a keep: stages/train/previous.py)."""
        return ([p.name for p in self.run_dir.iterdir()] == [LOCK_NAME]
                and self._path.stat().st_ino == self._inode)


def finite(loss_sum: torch.Tensor, params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Whether the loss and every LoRA gradient are finite, as a device tensor (no sync: the recipe reads it
    with the step's other figures)."""
    ok = torch.isfinite(loss_sum).all()
    for p in params:
        if p.grad is not None:
            ok = ok & torch.isfinite(p.grad).all()
    return ok


def nonfinite_message(step: int, per_sample: dict[str, float], store: Path) -> str:
    bad = [k for k, v in per_sample.items() if not torch.isfinite(torch.tensor(v))]
    named = bad or list(per_sample)
    which = "non-finite loss of samples" if bad else "non-finite gradient from the step's samples"
    shown = ", ".join(named[:8]) + (f" … ({len(named)} in all)" if len(named) > 8 else "")
    # Not "run store verify": verify checks bytes against checksums, and a faulty encoder writes NaN with valid ones.
    return (f"optimizer step {step}: {which} {shown}; nothing of this step was applied or saved. If the same "
            "samples fail again, their stored features hold NaN/inf (intact checksums, so `store verify` passes): "
            "leave them out with train.on_nonfinite=skip_step and re-encode them (encode in float32: "
            "--set encode_vae.dtype=float32 / encode_text.dtype=float32); if other samples fail each time, lower "
            "train.learning_rate")


def check_lora_finite(params: list[torch.nn.Parameter], what: Path) -> None:
    bad = sum(int((~torch.isfinite(p.detach())).sum()) for p in params)
    if bad:
        total = sum(p.numel() for p in params)
        raise NonFiniteError(f"{bad} of {total} LoRA values are non-finite: not writing {what}")


def record_skipped(run_dir: Path, damaged: dict[str, str], rerun: str = "rerun with --resume",
                   step: int | None = None) -> Path:
    """Add samples left out as damaged (key -> problem) at optimizer step `step` to RUN/damaged_samples.jsonl (`damaged_log`: appended
    under a lock, so no rank drops another's findings; a resume adds to the list of the earlier starts). A full
    disk is one line naming the file and the space free."""
    from stages.train import damaged_log

    with one_line_errors(f"the damaged-sample list {damaged_log.NAME}", run_dir, resume_advice(rerun)):
        return damaged_log.append(run_dir, damaged, step)


# What a failed checkpoint or final LoRA write leaves the user to do (`run train`: a rerun without --resume is
# refused, the run folder holding checkpoints; `run all` resumes by itself and has no --resume: `Run.rerun`).
def resume_advice(rerun: str = "rerun with --resume") -> str:
    return f"{rerun} to continue from the last committed checkpoint"


@contextmanager
def one_line_errors(what: str, where: Path, then: str = "") -> Iterator[None]:
    """A failed write (full disk, read-only folder, ...) becomes one clear line (`then` added: what to run next);
    `store.format.atomic_dir` inside has removed its temp folder, so the committed checkpoints and LoRA are
    untouched."""
    from store.io_errors import describe

    try:
        yield
    except Exception as e:
        err = describe(e, what, where)
        if err is None:
            raise
        raise (type(err)(f"{err}; {then}") if then else err) from None
