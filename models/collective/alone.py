"""Work where the other ranks may wait inside a collective this rank will not join (`fails_alone`: DDP's forward and
backward), or work rank 0 does alone while the others wait through the store (`main_alone`): a failure there is
published to every rank's watch thread, and out of memory is named as such."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from models.collective import timing
from models.collective.counting import _count_and_wait
from models.collective.errors import RankFailed, _message, agreed
from models.collective.interrupt import _tell_interrupt
from models.collective.publish import lost_peer_line, publish_failure
from models.collective.reconnect import _read
from models.collective.store_client import _launch_key, _store_client
from models.collective.watch import watch_failures
from schemas.errors import UserError

T = TypeVar("T")


def out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, (torch.OutOfMemoryError, MemoryError))


@contextmanager
def fails_alone(world: int, what: str, oom_advice: str = "") -> Iterator[None]:
    """Run this rank's own part of a step (its data, its forward and backward) where the other ranks may be
    inside a collective it will not join: an error is published to every rank (the package's doc) and raised
    here as `RankFailed` with the same line, so the failing rank unwinds and reports it without a traceback.
    Out of memory is named as such, with `oom_advice` (what to change), in one process too (the one-GPU user's
    case: a CUDA traceback said nothing of what to change); other errors of one process pass through."""
    if world <= 1:
        try:
            yield
        except Exception as e:  # noqa: BLE001 - out of memory only: the rest passes through as it is
            if not out_of_memory(e):
                raise
            first = (str(e).splitlines() or [""])[0]
            raise UserError(f"ran out of memory in {what} ({first})" + (f": {oom_advice}" if oom_advice else "")) from e
        return
    watch_failures(world)
    try:
        yield
    except KeyboardInterrupt as e:
        _tell_interrupt(e, world, what)
        raise
    except Exception as e:  # noqa: BLE001 - published to every rank
        if agreed(e):
            raise
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if out_of_memory(e):
            first = (str(e).splitlines() or [""])[0]
            text = f"rank {rank} ran out of memory in {what} ({first})" + (f": {oom_advice}" if oom_advice else "")
        elif isinstance(e, UserError):
            text = _message(e, what)
        elif (lost := lost_peer_line(e)) is not None:  # a peer killed in DDP's backward: not this rank's fault
            text = lost
        else:
            text = f"rank {rank}: {_message(e, what)}"
        raise RankFailed(publish_failure(" ".join(text.splitlines()), world)) from None


def main_alone(world: int, what: str, work: Callable[[], T], oom_advice: str = "") -> T | None:
    """`work` on rank 0 alone while the other ranks wait for it, however long it takes (resize-bucket over a
    million samples: hours, where a process-group barrier would time out, and before any process group exists):
    rank 0 marks it done in the launcher's store, which the others poll, and waits (at most HOST_WAIT_SECONDS) until
    every rank has seen the mark, as the store may end with it (`_count_and_wait`). A failure on rank 0 is published
    (`fails_alone`, out of memory named with `oom_advice`) and every other rank's watch thread stops its process
    with the same line. Rank 0's result there, None on the others; one process: `work()`."""
    if world <= 1:
        return work()
    try:
        client = _store_client()
    except Exception as e:  # noqa: BLE001 - e.g. a platform set WORLD_SIZE / MASTER_* for a job no launcher runs
        raise UserError(f"{what} runs on rank 0 while the other ranks wait, through the launcher's store, but none "
                        f"answers at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                        f"({type(e).__name__}): launch with `pipeline launch` (torchrun); where no launcher started "
                        "this command (a platform set WORLD_SIZE for the job), unset WORLD_SIZE for it") from None
    if client is None:
        raise UserError(f"{what} runs on rank 0 while the other ranks wait, through the launcher's store, but the "
                        "launch named none (MASTER_ADDR / MASTER_PORT): launch with `pipeline launch` (torchrun)")
    key = f"{_launch_key('done')}/{what}"
    if int(os.environ.get("RANK", "0")) == 0:
        with fails_alone(world, what, oom_advice):
            result = work()
        client.set(key, "done")
        # the command may end right after (`run resize-bucket`), and in a plain env:// launch this process serves
        # the store: a rank still sleeping in its poll then found it gone and ended on a lost-peer line, exit 1,
        # though the work had succeeded. Every rank counts itself once it has seen the mark; this one waits for it
        _count_and_wait(client, f"{key}/seen", world)
        return result
    watch_failures(world)  # rank 0's failure ends this process with its line
    # no progress bar: these ranks print nothing of their own, rank 0 shows the work's bars
    clients = [client]
    while not _read(clients, lambda c: c.check([key])):
        time.sleep(timing.POLL_SECONDS)
    _count_and_wait(clients[0], f"{key}/seen", world, wait=False)
    return None
