"""Whether the process serving the launch's store has ended (`store_host_gone`), seen through an idle connection of
our own, never through torch's client; `forget_store_hosts` starts a run's canaries afresh."""

from __future__ import annotations

import os
import select
import socket
import threading

from models.collective import state, timing


_canary_lock = threading.Lock()


def forget_store_hosts() -> None:
    """Close this process's canaries (`store_host_gone`) and forget the store hosts it saw gone: the state of one
    run's store, not of its address for the process life. Called when a run sets up its store (its first exchange,
    `_before_group_store`; its watch, `watch_failures`) and when it is done with it (`_stop_watching`, at its exit).
    Before, a host seen gone stayed gone for that address: a later run of a long-lived process (tests; a notebook)
    given the same port by the next launch found every wait failed at once; and the canaries stayed open."""
    with _canary_lock:
        for canary in state.run.get("canaries", {}).values():
            if canary:  # False: none could be made; None: closed already
                canary.close()
        state.run["canaries"], state.run["hosts_gone"] = {}, set()


def store_host_gone() -> bool:
    """Whether the process serving the launch's store has ended (rank 0 of a plain env:// launch killed, a node's
    torchrun agent gone), seen without a call through torch's client: a call on a connection its peer closed
    prints c10d's warning and C++ stack ("recvValue failed ... Connection reset by peer") before it raises, two
    of them (the main thread's wait, the watch thread's poll) before the rank's one line. Told by a connection of
    our own to the store's port, opened once and never written to: the store never sends on it, so it reads
    only when the peer's process is gone (end of file, a reset; the kernel closes a killed process's sockets),
    which a refused connection to the port confirms (`_reconnect`'s own test of a host that ended). A
    host that ended during a call in flight still shows torch's warning (a call's microseconds); a node lost with
    its kernel closes nothing (calls time out, as before). False where no connection could be made."""
    where = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    if not where[0] or not where[1]:
        return False
    with _canary_lock:
        # per address: the store a launch names (a run's: `forget_store_hosts` replaces both)
        canaries, gone = state.run.setdefault("canaries", {}), state.run.setdefault("hosts_gone", set())
        if where in gone:
            return True
        canary = canaries.get(where)
        if canary is False:  # could not be made: the calls say what they meet, as before
            return False
        if canary is None:
            try:
                # tried once (each poll of a long wait comes here; a port that does not answer costs PROBE_SECONDS)
                canary = socket.create_connection((where[0], int(where[1])), timeout=timing.PROBE_SECONDS)
            except (OSError, ValueError):
                canary = False
            canaries[where] = canary
            if canary is False:
                return False
        try:
            # poll, not select: select refuses a descriptor past 1024 (ValueError), which a rank holding many files
            # open (shards, loader pipes, NCCL's sockets) gets
            ready = select.poll()
            ready.register(canary, select.POLLIN)
            if not ready.poll(0):
                return False
            closed = canary.recv(1, socket.MSG_PEEK) == b""
        except OSError:  # reset by the kernel of a host whose process ended
            closed = True
        if not closed:
            return False
        # closed: gone only where its port refuses too (a store that closed this idle connection itself still
        # listens: a new one next time, never a live launch's store taken for gone)
        canaries[where] = None
        canary.close()
        try:
            socket.create_connection((where[0], int(where[1])), timeout=timing.PROBE_SECONDS).close()
            return False
        except ConnectionRefusedError:
            gone.add(where)
            return True
        except OSError:  # no answer (a loaded host, a network blip): the calls say what they meet
            return False
