"""Training metrics through accelerate's tracker interface (`train.log_with`), and a `torch.profiler` trace.

`Trackers` builds each named tracker from accelerate's registry (`accelerate.tracking.LOGGER_TYPE_TO_CLASS`:
tensorboard, wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio) on the main process, and offers
the two calls the trainer makes: `log({name: value}, step)` and `add_image(...)` (`add_scalar` for one value).
TensorBoard, the default, writes RUN/logs as before (with `purge_step` on resume, so a killed run's events after
its last checkpoint are dropped; a fresh start removes a killed start's event files and traces: `forget_logs`);
the others are optional packages (`pip install wandb` / `mlflow`), an unknown or missing one is a one-line error
before training starts.

`StepProfiler` (`train.profile: N`) records the first N optimizer steps of this start with `torch.profiler` and
writes RUN/profile/trace-rank{R}.json (Chrome trace format: chrome://tracing, Perfetto, TensorBoard's profiler);
the ranks write theirs at the same step and agree on it (a full disk on one stops all with its line).
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from schemas import atomic_write
from schemas.errors import UserError

TRACE_DIR = "profile"
LOGS_DIR = "logs"


def forget_logs(run_dir: Path) -> None:
    """A fresh start's logs begin anew: the TensorBoard event files and profiler traces of a start killed before
    its first checkpoint go (as its validation curve does). Its writer's purge at step 1 hid its events from
    TensorBoard only, and only while its file sorts after theirs (names begin with the writing host's clock);
    other readers of RUN/logs got both runs' points. Its traces stayed when this start profiles fewer ranks or
    none, read as this run's. Other trackers keep each start a run of its own."""
    for folder, pattern in ((run_dir / LOGS_DIR, "events.out.tfevents.*"), (run_dir / TRACE_DIR, "trace-rank*"),
                            (run_dir / TRACE_DIR, ".trace-rank*")):  # the last: temp files of a killed write
        if folder.is_dir():
            for p in folder.glob(pattern):
                p.unlink(missing_ok=True)


def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    """Nested config -> {"train/learning_rate": 1e-4, ...}: trackers take only bool / str / int / float."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "/"))
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        else:
            out[key] = str(v)
    return out


# a clock this far ahead of ours wrote the newest event file: not waited for (the order is then the reader's)
AHEAD_SECONDS = 5


def after_earlier_logs(logs: Path) -> None:
    """Return once a new event file's name sorts after every one in `logs`. Readers (TensorBoard) read a run's
    files in name order, and a name is `events.out.tfevents.SECONDS.HOST.PID.N`: a resume started within the second
    of the killed start's file sorted by pid and a per-process counter (9 < 10 fails as text), read before it, and
    its purge then hid the resumed points (CI, a kill and resume in one process). At most a second's wait."""
    import time

    newest = max((int(m) for f in logs.glob("events.out.tfevents.*")
                  if (m := f.name.split(".")[3]).isdigit()), default=None)
    if newest is None or newest - time.time() > AHEAD_SECONDS:
        return
    while int(time.time()) <= newest:
        time.sleep(0.05)


def tracker_classes(names: list[str]) -> list[type]:
    """The accelerate tracker classes for `train.log_with`; a clear error for an unknown or uninstalled one."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS
    from accelerate.utils import imports

    out = []
    for name in names:
        if name not in LOGGER_TYPE_TO_CLASS:
            raise UserError(f"train.log_with: unknown tracker {name!r}; one of {', '.join(sorted(LOGGER_TYPE_TO_CLASS))}")
        available = getattr(imports, f"is_{name}_available", None)
        if name != "tensorboard" and available is not None and not available():
            raise UserError(f"train.log_with: {name} is not installed; `pip install {name}` or log with tensorboard")
        out.append(LOGGER_TYPE_TO_CLASS[name])
    return out


class Trackers:
    """The run's metric loggers (main process only)."""

    def __init__(self, names: list[str], run_dir: Path, config: dict, purge_step: int | None):
        self.trackers = []
        for cls in tracker_classes(names):
            if cls.name == "tensorboard":  # RUN/logs, as the SummaryWriter wrote it before
                if purge_step:
                    after_earlier_logs(run_dir / LOGS_DIR)
                t = cls(LOGS_DIR, str(run_dir), **({"purge_step": purge_step} if purge_step else {}))
            elif cls.requires_logging_directory:
                t = cls(run_dir.name, str(run_dir / LOGS_DIR))
            else:
                t = cls(run_dir.name)
            t.start()
            if cls.name != "tensorboard":  # TensorBoard keeps the config in RUN/config.yaml already
                t.store_init_configuration(_flat(config))
            self.trackers.append(t)

    def _each(self, what: str, call: Callable[[Any], None]) -> None:
        """`call` on every tracker; one that fails (its server gone, a full disk under RUN/logs) is named in one
        line and dropped: metrics must not end a run that trains fine (only its checkpoints and LoRA do)."""
        for t in list(self.trackers):
            try:
                call(t)
            except Exception as e:
                self.trackers.remove(t)
                tqdm.write(f"warning: train.log_with {t.name} failed {what} ({type(e).__name__}: {e}); training "
                           "goes on without it")

    def log(self, values: dict[str, float], step: int) -> None:
        self._each(f"at step {step}", lambda t: t.log(values, step=step))

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.log({name: value}, step)

    def add_image(self, name: str, image: np.ndarray, step: int, dataformats: str = "HWC") -> None:
        def add(t) -> None:
            if t.name == "tensorboard":
                t.writer.add_image(name, image, step, dataformats=dataformats)
                # on disk now: a sample grid's PNG, written next, tells a resume the step's grid is done
                # (`_grid_recorded`); queued, a kill before the next flush lost the image for good
                t.writer.flush()
            elif hasattr(t, "log_images"):
                t.log_images({name: [image]}, step=step)

        self._each(f"at step {step}", add)

    def close(self) -> None:
        self._each("when closing", lambda t: t.finish())
        self.trackers = []  # closed: a second close (cleanup after finish) does nothing


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process on its device since the start: CUDA's allocator peak, or the process's peak
    resident host memory (ru_maxrss, KiB on Linux) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class StepProfiler:
    """`torch.profiler` over the next `steps` optimizer steps (call `step()` after each); writes the trace once."""

    def __init__(self, steps: int, run_dir: Path, rank: int, device: torch.device,
                 rerun: str = "rerun with --resume", world: int = 1):
        from torch.profiler import ProfilerActivity, profile

        self.left, self.rerun, self.world = steps, rerun, world
        self.path = run_dir / TRACE_DIR / f"trace-rank{rank}.json"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        self.prof.start()

    def step(self) -> None:
        if self.left <= 0:
            return
        self.prof.step()
        self.left -= 1
        if self.left == 0:
            from models.collective import together

            # every rank writes its trace at the same step: agreed, so a full disk on one rank stops every rank
            # with its line (not only that one, the others waiting for it in the next gradient all-reduce)
            with together(self.world, f"the profiler trace {self.path.name}"):
                self.prof.stop()
                self._write()

    def _write(self) -> None:
        """The trace, whole or not at all; a full disk is one line naming the file and the MB free."""
        from stages.train.guard import one_line_errors, resume_advice

        with one_line_errors(f"the profiler trace {self.path.name}", self.path.parent,
                             f"{resume_advice(self.rerun)} (or set train.profile=0 to train without a trace)"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write.atomic_path(self.path) as tmp:  # a trace file that exists is whole
                self.prof.export_chrome_trace(str(tmp))
