"""A failure told to every rank through the launch's store (`publish_failure`, `failure_line`), a peer's line read
from there (`peer_failure`, `peer_line`), and the lines for a peer gone without a word (`lost_peer_line`) or an
error no handler made a line of (`publish_uncaught`, `rank_error_line`)."""

from __future__ import annotations

import os
from typing import Callable

from models.collective import state, timing
from models.collective.canary import store_host_gone
from models.collective.counting import _known_by_all
from models.collective.errors import _mark, agreed
from models.collective.reconnect import _read
from models.collective.report import _untold_warning
from models.collective.store_client import (StoreSilent, _again_timeout, _call, _failure_key, _hosts_store,
                                            _store_client, signs_of_life)


def publish_failure(message: str, world: int) -> str:
    """Tell every rank's watch thread that this rank failed with `message`; the line every rank prints (the
    first one published, when several ranks fail at once). Without a store, `message` itself."""
    line = _publish(message, world)
    return message if line is None else line


def _publish(message: str, world: int) -> str | None:
    """`publish_failure`, or None when no store could be reached (nothing published)."""
    if not state.run["watching"]:
        return None
    return _write_failure(message, world)


def _write_failure(message: str, world: int, timeout: float = 10.0, watching_only: bool = False) -> str | None:
    """Write `message` under the launch's failure key unless a line is there already (that one is returned), then
    wait for the ranks to read it (`_known_by_all`); None when no store could be reached in `timeout` seconds.
    `watching_only`: wait only for the ranks watching already (`_watching_ranks`), for a publisher that cannot
    know whether any rank waits for it (one stopped before its own first exchange)."""
    state.run["published"] = True
    if store_host_gone():  # its port refuses: `_store_client` took that for a store still starting, `timeout` long
        return None
    try:
        client = _store_client(_again_timeout(timeout))
        if client is None:
            return None
        key, clients = _failure_key(), [client]
        # tried again after a hiccup (`_read`; a compare-and-set writes once): unpublished, the line reached no rank,
        # which ended on another (a lost peer's) or, waiting in `arrive_together`, only after LOST_SECONDS
        line = _read(clients, lambda c: c.compare_set(key, "", message)).decode("utf-8", "replace")
        _known_by_all(clients[0], key, world, _watching_ranks(lambda op: _read(clients, op), world)
                      if watching_only else None)
        return line
    except StoreSilent as e:  # said: a rank's exit held for ever there before, then nothing said why it took its time
        _untold_warning(str(e))
        return None
    except Exception:  # noqa: BLE001 - no store: the others learn it at their next agreement, if ever
        return None


def _watching_ranks(call: Callable, world: int) -> list[int]:
    """The other ranks whose watch thread has counted a sign of life (`signs_of_life`): those that may wait for this
    one (a rank waiting at an exchange or an arrival watches from its first exchange on) and read a line it
    publishes within POLL_SECONDS. A rank with none is still starting: it reads the line at its first exchange, if
    the store is still up, and no wait here would make it read sooner. `call(op)`: one store call (`_read`)."""
    me = int(os.environ.get("RANK", "0"))
    others = [r for r in range(world) if r != me]
    return [r for r, beats in zip(others, signs_of_life(call, others)) if beats > 0]


def peer_failure() -> str | None:
    """The line another rank published, if any (for a main thread that met a collective error first: a peer's
    exit closes the gloo connections)."""
    if not state.run["watching"] or store_host_gone():  # gone: nothing to read (a connect retried it for 10 s)
        return None
    try:
        client = _store_client(_again_timeout(10.0))
        if client is not None and _call(client, lambda c: c.check([_failure_key()])):
            line = _call(client, lambda c: c.get(_failure_key())).decode("utf-8", "replace")
            _known_by_all(client, _failure_key(), state.run["world"])  # this rank ends on it
            return line
    except Exception:  # noqa: BLE001
        pass
    return None


def ending_line() -> str | None:
    """The line this process ends on, for a stop that lands before it printed it (the CLI's SIGTERM handler:
    torchrun's agent stops a node's other workers once one exited): the agreed failure it is reporting
    (`failure_line`), else a line another rank published (`peer_failure`)."""
    return state.run.get("ending") or peer_failure()


# what gloo says on this side of a connection whose other process is gone (its TCP pairs are closed by the kernel)
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def lost_peer_line(error: BaseException) -> str | None:
    """The one line for a collective that failed because another rank's process is gone without a word - killed
    (`kill -9`, the out-of-memory killer) or its node lost, so nothing was published (`fails_alone`) - else None.
    Without it this rank ended in gloo's traceback, naming no rank and no way on."""
    import torch.distributed as dist

    text = str(error)
    if not (isinstance(error, dist.DistNetworkError) or
            (isinstance(error, RuntimeError) and "gloo" in text and any(p in text for p in _LOST_PEER))):
        return None
    detail = next((p for p in _LOST_PEER if p in text), (text.splitlines() or [type(error).__name__])[0])
    return (f"rank {os.environ.get('RANK', '?')} lost its connection to another rank ({detail}): that rank's "
            "process ended without a word (killed: `kill -9`, the out-of-memory killer - `dmesg` on its node says - "
            "or its node lost); the launcher's line names it. What the ranks committed is kept: rerun the same "
            "command to continue (`run train`: with --resume)")


def failure_line(error: BaseException, line: str) -> str:
    """The line a process prints at its top level for `error` (one-line text `line`). With several ranks, an error
    the others do not know of yet is published first (they stop with it), and a line published before (another
    rank's failure, of which this error may be a consequence) wins, so every rank prints the same."""
    if agreed(error) and state.run["watching"]:
        # the line a SIGTERM landing from here on ends this rank with (`ending_line`): under torchrun another worker
        # of this node that printed it first exits, and the agent stops this one at once (nothing published to find)
        state.run["ending"] = line
    if agreed(error) and state.run.get("stop_watching") is not None:
        # every rank knows and is about to exit: nothing left to watch for, and a poll of a store whose host
        # (rank 0) exited first logged a C++ stack after this line (its last line was no longer the error)
        state.run["stop_watching"]()
    if agreed(error):
        return line
    if not state.run["watching"]:
        line = _publish_unwatched(line)
    else:
        import torch.distributed as dist  # watching: a launch of several ranks

        line = publish_failure(line, dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"]))
    # once: a second handler of the same error (the CLI's top level after `user_errors`) publishes nothing more,
    # where a second try cost another store connection and another wait for a rank that never counts
    _mark(error)
    return line


def peer_line(error: BaseException) -> str | None:
    """The line for an error that is another rank's failure seen from here, not this rank's own: the line a peer
    published (gloo's "connection closed" once a failed rank exited), or, launched, a peer's process gone without
    a word (`lost_peer_line`, published: the ranks not in touch with it stop too); None for this rank's own error.
    The one choice of every top-level handler (pipeline/commands/common.py `user_errors`, the CLI's `main`)."""
    if (peer := peer_failure()) is not None:
        _mark(error)  # every rank knows the peer's line: nothing of this rank's to publish
        return peer
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and (lost := lost_peer_line(error)) is not None:
        return failure_line(error, lost)
    return None


def publish_uncaught(error: BaseException) -> str | None:
    """For an error no handler turned into a line, unless already published (`user_errors` publishes what it
    re-raises): a peer's line (`peer_line`) for the process to end with instead of a traceback, else None after
    publishing `rank_error_line` (its traceback is this rank's)."""
    if agreed(error):
        return None
    if (line := peer_line(error)) is not None:
        return line
    failure_line(error, rank_error_line(error))
    return None


def _publish_unwatched(line: str) -> str:
    """`failure_line` for a launched rank that fails before its own first exchange through the store (a node that
    cannot read its config file, a broken install): it watches nothing yet, but the others may be waiting for it
    at theirs already (for BEFORE_GROUP_SECONDS), their watch threads running: it publishes too, where a store is
    up. torchrun's agent serves one from the start; in a plain env:// launch rank 0 serves it from its first
    exchange on, so rank 0 (no store to reach) does not try, and another rank gives up after
    UNWATCHED_STORE_SECONDS. One process, or a launch naming no store: `line`, nothing published."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return line
    if _hosts_store():
        return line
    published = _write_failure(line, world, timing.UNWATCHED_STORE_SECONDS)
    return line if published is None else published


def rank_error_line(error: BaseException) -> str:
    """The line the other ranks print for an error this rank did not expect (a bug, a broken install on its node),
    which ends this process in its traceback: `rank N: TypeName: message`, so they name the rank to look at."""
    text = " ".join(f"{type(error).__name__}: {error}".splitlines())
    return f"rank {os.environ.get('RANK', '?')} failed: {text} (its traceback is in that rank's output)"
