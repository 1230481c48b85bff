"""A rank frozen inside the training steps (SIGSTOP, a node that hung or lost its network): the others wait for it
in DDP's gradient all-reduce, where nothing but the process group's timeout ends them (NCCL: 10 minutes, gloo: 30),
and then in a watchdog's abort or a traceback that names no rank. While the ranks train in lockstep (`lockstep`),
each watch thread (models/collective/watch.py) also judges the others' signs of life: when this rank's own steps
have made no progress for LOST_SECONDS and a peer's watch thread has counted none for as long, that peer is frozen,
and every rank stops with one line naming it. Both must hold: a slow step (a long validation, rank 0's checkpoint
write) keeps every peer's signs of life coming, and a peer silent only because its store connection failed leaves
the steps going on."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

from models.collective import state, timing
from models.collective.store_client import signs_of_life


@contextmanager
def lockstep() -> Iterator[None]:
    """Within the block every rank trains in lockstep, marking its progress (`progressed`) as it goes."""
    progressed()
    try:
        yield
    finally:
        state.run.pop("progress", None)


def progressed() -> None:
    """This rank made progress (a micro-batch or a step done)."""
    state.run["progress"] = time.monotonic()


def stalled(seconds: float) -> bool:
    """Whether this rank trains in lockstep and has made no progress for `seconds`."""
    last = state.run.get("progress")
    return last is not None and time.monotonic() - last > seconds


def frozen_peers(call: Callable, world: int, me: int, seen: dict[int, tuple[int, float]]) -> list[int]:
    """The other ranks whose signs of life (`signs_of_life`: two store calls) have not changed for LOST_SECONDS, as
    this watch thread has seen them (`seen`: rank -> (count, when it last changed)). `call(op)`: one store call."""
    now, frozen = time.monotonic(), []
    others = [r for r in range(world) if r != me]
    for r, beats in zip(others, signs_of_life(call, others)):
        if r not in seen or seen[r][0] != beats:
            seen[r] = (beats, now)
        elif now - seen[r][1] > timing.LOST_SECONDS:
            frozen.append(r)
    return frozen


def frozen_line(ranks: list[int], world: int) -> str:
    from models.agreement import few

    return (f"rank(s) {few(ranks)} of {world} gave no sign of life for {timing.LOST_SECONDS:.0f} s while the others "
            "waited for them in a training step (frozen: a SIGSTOP, a hung node, or its node lost its network); "
            "what the ranks committed is kept: rerun with --resume to continue")
