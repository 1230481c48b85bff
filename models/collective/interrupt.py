"""A Ctrl-C that stopped one rank, told to the others through the launch's store (`_tell_interrupt`,
`publish_interrupt`), so they stop at once with its line instead of waiting for it."""

from __future__ import annotations

import os
import socket

from models.collective import state, timing
from models.collective.canary import store_host_gone
from models.collective.errors import _mark, agreed
from models.collective.publish import _write_failure, publish_failure
from models.collective.store_client import _hosts_store


def _tell_interrupt(error: BaseException, world: int, what: str) -> None:
    """A Ctrl-C that reached this rank alone (its own terminal, one node's) in `what`: published, so the other
    ranks - inside a collective this rank will not join, or waiting for it to arrive - stop at once with one line,
    where they waited for the collective's timeout (NCCL without torchrun: 10 minutes) or named this rank as killed
    after LOST_SECONDS. The KeyboardInterrupt goes on here: this rank stops as a Ctrl-C stops it, nothing past the
    last commit kept (docs/train.md). Once (nested blocks; every rank of a terminal's Ctrl-C: the first line wins)."""
    if agreed(error):
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    publish_failure(_interrupt_line(rank, what), world)
    _mark(error)


def _interrupt_line(rank: int | str, what: str) -> str:
    return (f"rank {rank} was stopped by SIGINT (Ctrl-C){' in ' + what if what else ''}: what the ranks committed is "
            "kept (a run's checkpoints); rerun the same command to continue (`run train`: with --resume)")


def publish_interrupt(error: BaseException) -> None:
    """A Ctrl-C that stopped this launched rank outside `fails_alone` / `together` (waiting in `arrive_together`, rank
    0 writing a checkpoint alone, an encoder's own loop), told once its exit is under way (the CLI's top level): as
    `_tell_interrupt` does inside them, so the ranks waiting for this one stop at once with its line, where they
    named it as killed after LOST_SECONDS. Not where it was told already (`agreed`), nor to a store whose host
    has ended (`store_host_gone`); otherwise bounded as every publish is (`_write_failure`). Before this rank's
    first exchange too (`_publish_unwatched_interrupt`)."""
    if agreed(error):
        return
    if not state.run["watching"]:
        _publish_unwatched_interrupt(error)
        return
    if store_host_gone():
        return
    _tell_interrupt(error, state.run["world"], "")


def _publish_unwatched_interrupt(error: BaseException) -> None:
    """`publish_interrupt` of a rank stopped before its own first exchange (loading its config, importing torch):
    the others may wait for it at theirs already, for BEFORE_GROUP_SECONDS (30 minutes) - before, nothing was
    published. Told where the store answers at once (one probe of its port, PROBE_SECONDS: a Ctrl-C's exit is not
    held for a store still starting, as `_publish_unwatched` waits for one), through a connect bounded by
    CONNECT_SECONDS, then a wait for the ranks watching already to read it (`_watching_ranks`; HOST_WAIT_SECONDS at
    most, a second Ctrl-C ends it): before, it waited for every rank, the whole bound where none had reached its
    first exchange yet (nobody waiting for this one, nobody to read the line now; 14 s in all with torch's import,
    a second Ctrl-C needed). Not by rank 0 of a plain env:// launch: the store is its own from its first exchange
    on, so none is up yet and no rank can be waiting at one (they wait for it to come up, as for any rank 0 that
    never starts)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world <= 1 or not host or not port or _hosts_store() or _one_agents_ranks(world):
        return
    try:
        socket.create_connection((host, int(port)), timeout=timing.PROBE_SECONDS).close()
    except (OSError, ValueError):  # not up (or not answering): nobody reads it there now
        return
    _write_failure(_interrupt_line(os.environ.get("RANK", "?"), ""), world, timing.CONNECT_SECONDS, watching_only=True)
    _mark(error)


def _one_agents_ranks(world: int) -> bool:
    """Whether every rank of the launch is a worker of this node's torchrun agent (one node): this rank's exit
    makes the agent stop every other rank at once (it restarts or ends the whole group), and a Ctrl-C's line is
    the agent's (pipeline/commands/launch.py), so a stop before the first exchange has no one to tell. Its exit
    then imports no torch and connects to no store: a terminal's Ctrl-C reaches every rank and the agent, which
    waits for its ranks' exits, and each rank's took seconds (a second Ctrl-C needed)."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and os.environ.get("LOCAL_WORLD_SIZE") == str(world)
