"""A scheduler's SIGTERM (preemption, `scancel`, torchrun stopping its workers) ends training after the optimizer
step under way, with a checkpoint of that step, instead of at once: the steps since the last checkpoint
(`train.checkpoint_every`, 50 by default) are kept, and `--resume` goes on from there.

The signal only sets a flag here; the step's loss all-reduce carries it (one more number, no extra collective), so
every rank learns of a signal that reached any of them at the same step, writes the same checkpoint together and
then stops as the signal would have stopped it (the handler it replaced: the CLI's one-line exit, status 143).
A SIGTERM that comes while a checkpoint is written stops right after it, without another step (the checkpoint
just written is the resume point; one more step would spend the scheduler's grace period on work the resume
redoes): the ranks agree on it in one all-reduce after each checkpoint (`pending`).
With gradient accumulation (`train.grad_accum` > 1) a step can outlast the grace period (the real model at 1 MP:
1-2 s a micro-batch, 32-64 of them): the ranks also agree at each micro-batch boundary (`at_micro_batch`, one
all-reduce of one integer per micro-batch on the run's group: under NCCL a host sync each, the GPU idle only until
the next micro-batch's first kernel), and a signal there drops the partial step (weights, optimizer and schedule are untouched until the
update; the data position, token counts and RNG are put back to the step's start) and stops with the last
completed step's checkpoint (written unless it exists already): the resume trains the straight run's LoRA.
A SIGTERM after the request has gone into a step's all-reduce stops at once, as before. Not simply the second
one: under SLURM (`scancel`, preemption) every process of the job step is sent SIGTERM, and torchrun's agent
passes its own on to the ranks, so each rank gets two at once. Schedulers send SIGKILL after a grace period
(SLURM's KillWait, 30 s by default; torchrun's agent: 30 s): a step plus a LoRA checkpoint fits in it; where it
does not, nothing is worse than the immediate stop (the last committed checkpoint stays the resume point).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any


# SIGTERMs the CLI's handler turned into SystemExit before the training loop, and SIGINTs it turned into
# KeyboardInterrupt at any time (pipeline/cli.py records them here once this module is loaded). Python ignores an
# exception raised inside a finalizer (`__del__`, a weakref callback, run whenever the garbage collector does): a
# signal that lands while one runs is lost with it, and the process went on into 100000 steps (a SIGTERM, then a
# Ctrl-C: CI, once each). The loop then acts on it as on a SIGTERM it recorded itself (`requested`).
EARLIER: list[int] = []
# The signals whose stop the training loop has said in a line of its own (the checkpoint written, how to go on):
# the CLI's generic line for a stop (pipeline/cli.py) is then left out.
ANNOUNCED: list[int] = []


def _recorded_by_cli() -> list[int]:
    """The signals the CLI's handlers recorded (pipeline/cli.py `_signalled`), those that came before this module
    was imported too: a Ctrl-C while the model stack was imported, lost in a finalizer (`regex`'s `__del__`),
    reached no EARLIER and the run trained every step and exited 0 (bench/chaos_kill.py, SIGINT 4.2 s in)."""
    return list(getattr(sys.modules.get("pipeline.cli"), "_signalled", ()))


class StopOnSignal:
    """Within the `with` block (the training loop, main thread only): SIGTERM recorded, not acted on."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._passed_on = False  # the request went into a step's all-reduce: another SIGTERM insists
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = signal.signal(signal.SIGTERM, self._record)
            self._installed = True
        earlier = EARLIER or _recorded_by_cli()
        if earlier:  # one that stopped nothing (see EARLIER): the first step's checkpoint, then the stop
            self.signum = earlier[0]
            EARLIER.clear()
        return self

    def __exit__(self, kind=None, error=None, tb=None) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
        if self.signum is not None and isinstance(error, Exception):
            # the step under way failed after the signal came (torchrun stops the other ranks when one dies: the
            # dead one's connections close under this one's collective): stop as the signal would have at once.
            # A one-line error (a full disk at the stop's checkpoint) is still shown: the exit alone says nothing.
            from schemas.errors import UserError

            if isinstance(error, UserError):
                print(f"error: {error}", file=sys.stderr, flush=True)
            self._stop(self.signum, None)

    def _record(self, signum: int, frame) -> None:
        if self._passed_on:  # asked again after the request was acted on: stop now
            self._stop(signum, frame)
        self.signum = signum

    def requested(self) -> float:
        """1.0 once a signal came (a number for the step's all-reduce), else 0.0."""
        self._passed_on = self._asked()
        return 1.0 if self._passed_on else 0.0

    def _asked(self) -> bool:
        """Whether a signal came (this rank's), one the CLI recorded in EARLIER too."""
        if self.signum is None and EARLIER:  # a Ctrl-C whose KeyboardInterrupt a finalizer swallowed (EARLIER)
            self.signum = EARLIER[0]
            EARLIER.clear()
        return self.signum is not None

    def at_micro_batch(self, world: int) -> bool:
        """Whether a signal reached any rank, agreed at a micro-batch boundary (every rank calls this after the
        same micro-batch): one all-reduce of one integer on the run's own group (`all_max`). Under NCCL it is a
        host sync per micro-batch: the GPU then waits only for the next micro-batch's first kernel (under a
        millisecond against 1-2 s a micro-batch), where a CPU group of its own (gloo) would need gloo to reach
        every node, which a cluster whose host names resolve to an unroutable address (Debian's 127.0.1.1) denies,
        failing runs that trained before. Not passed on (`requested`): SLURM's SIGTERM and torchrun's copy come
        milliseconds apart and a boundary can fall between them; the second is held while its stop's checkpoint
        is written."""
        from models.collective import all_max

        return bool(all_max(world, [int(self._asked())])[0])

    def pending(self, world: int) -> bool:
        """Whether a signal reached any rank (after a checkpoint: every rank calls this, one all-reduce)."""
        from models.collective import all_max

        return bool(all_max(world, [int(self.requested())])[0])

    def by(self) -> str:
        """What the stop lines name as the stop's cause: this process's own signal ("SIGTERM", "SIGINT (Ctrl-C)",
        as the CLI's stop lines do), or "a signal" where the stop was agreed on another rank's."""
        if self.signum is None:
            return "a signal"
        return "SIGINT (Ctrl-C)" if self.signum == signal.SIGINT else signal.Signals(self.signum).name

    def stop_now(self, line: str | None = None) -> None:
        """End the process as the replaced handler would have for the signal (all ranks: the agreed stop).
        `line`: what the main process says of the stop (printed here, in place of the CLI's own line)."""
        signum = self.signum or signal.SIGTERM
        if line is not None:
            from tqdm.std import tqdm

            for bar in list(tqdm._instances):  # left as they stand: tqdm.write redrew the train bar under the line
                bar.close()
            tqdm.write(line)
            ANNOUNCED.append(signum)
        self.__exit__()
        self._stop(signum, None)

    def _stop(self, signum: int, frame) -> None:
        if callable(self._previous):
            self._previous(signum, frame)  # the CLI's handler raises SystemExit(128 + signum)
        raise SystemExit(128 + signum)
