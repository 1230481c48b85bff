"""A long use of the launch's store that outlives a hiccup: a new connection once the store answers again
(`_reconnect`), and the main thread's long wait's call tried again on it (`_read`)."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from typing import Callable, TypeVar

from models.collective import state, timing
from models.collective.canary import store_host_gone
from models.collective.store_client import StoreSilent, _bound, _call, _silent_line, _store_client, _where

T = TypeVar("T")


def _reconnect(clients: list, stop: threading.Event) -> bool:
    """After a failed call through `clients[0]`: a new connection there once the store answers again (True), or
    False where the store is gone - nothing listens on its port any more (its host ended: at once), or it did not
    answer for STORE_RETRY_SECONDS - or `stop` is set (this process exits). A new connection, as after a timeout
    the old one's late answer would be read as the next call's. Each try first opens a plain socket to the port:
    torch's client, trying a store that is gone, prints a C++ warning and stack each time (after a rank's last
    line, where its exit came after the host's). Meanwhile, and for good when False, the exit does not count
    itself in the store (`_count_exit`)."""
    state.run["store_lost"] = True
    state.found.gone = False
    host, port = os.environ.get("MASTER_ADDR"), int(os.environ.get("MASTER_PORT") or 0)
    if not host or not port:
        return False
    deadline, pause = time.monotonic() + timing.STORE_RETRY_SECONDS, timing.POLL_SECONDS
    held = getattr(clients[0], "timeout", None)  # None: no connection yet (`_watch`)
    timeout = held.total_seconds() if isinstance(held, timedelta) else 10.0  # `_store_client`'s default
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=timing.PROBE_SECONDS).close()
        except ConnectionRefusedError:
            # the store's host ended: the launch is over, whatever an earlier try met (a silent one: `_read`'s line)
            state.found.silent, state.found.gone = None, True
            return False
        except OSError:
            pass  # no answer yet (a loaded host, a network blip)
        else:
            try:
                # the timeout the replaced connection had for every later call (PROBE_SECONDS made a store busy for
                # 3 s, which the first connection waited out, fail each call through the new one)
                clients[0] = _store_client(timeout)
                state.run["store_lost"] = False
                return True
            except Exception:  # noqa: BLE001 - the port answers, the store not yet: try again
                pass
        stop.wait(pause)
        pause = min(2 * pause, timing.HEARTBEAT_SECONDS)
    return False


def _read(clients: list, read: Callable[[object], T]) -> T:
    """`read(client)` through `clients[0]` for a main thread's long wait (`arrive_together`, `main_alone`: hours),
    tried again on a new connection after a failed call (`_reconnect`): one hiccup of the store ended the rank in a
    traceback, and the launch with it. Reads only, or writes that are the same when applied twice (a `set`, a
    compare-and-set): a call that failed may have been applied. A store gone: its failure, as before. Each call is
    bounded (`_call`): against a store whose host stopped answering (SIGSTOP, hung) it blocked for ever, a Ctrl-C
    ignored; a store still silent after `_reconnect`'s tries ends the wait in one line (`StoreSilent`): those tries'
    own finding (`state.found`, this thread's), not the process's, which the watch thread's poll answered meanwhile
    clears.
    A batch of calls (`_lost_ranks`' look) is one `_read` per call, each bounded
    and tried again on its own: one bound for the whole batch ran out on a busy store of many ranks, and the batch
    was tried again for ever."""
    while True:
        if store_host_gone():
            raise _host_gone()
        try:
            return _call(clients[0], read)
        except Exception as e:  # noqa: BLE001 - re-raised below when the store does not answer again
            bound = _bound(clients[0])
            if not _reconnect(clients, threading.Event()):
                if getattr(state.found, "gone", False):  # refused after a silent try: the host ended since
                    raise _host_gone() from None
                if not isinstance(e, StoreSilent) and getattr(state.found, "silent", None):
                    # its tries connected and got no answer: said so, whatever the first call raised (torch's timeout)
                    raise StoreSilent(_silent_line(_where(), bound)) from None
                raise


def _host_gone() -> Exception:
    """What a call to a store whose process ended raises (its one line: `lost_peer_line`), without torch's C++
    warning."""
    import torch.distributed as dist

    return dist.DistNetworkError("Connection closed by peer: the launch's store's process ended")
