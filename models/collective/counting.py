"""Ranks counting themselves in the launch's store and waiting until all have (`_count_and_wait`, `_known_by_all`,
`_left_together`): a process whose end may end the store lets every rank read what it holds first."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from models.collective import state, timing
from models.collective.reconnect import _read
from models.collective.store_client import _ends_store, _hosts_store


def _known_by_all(client, key: str, world: int, ranks: list[int] | None = None) -> None:
    """Count this process, once, among the ranks that know the published line, then wait, at most
    HOST_WAIT_SECONDS, until every rank does (`_count_and_wait`). Called by each rank that is about to end on it
    (its publisher, a watch thread, a main thread that met a peer's exit first), because the store ends with a
    process on its node: rank 0 serves it in a plain env:// launch, and under torchrun the node's agent does,
    which stops once one of its workers has ended. A rank on another node that had not read the line by then (its
    watch thread polls every POLL_SECONDS and needs the GIL, which a long call of its main thread may hold) found
    the store gone and ended on another line (gloo's "connection closed"; NCCL: waited until the collective
    timeout). Ranks that fail at once each count themselves: no wait. A killed rank never counts: the others wait
    the bound. `ranks`: the only ranks waited for (None: all). The store's last use by this process
    (`_count_exit`)."""
    state.run["store_done"] = True
    watch = state.run.get("watcher")
    if watch is not None and watch[1] is not threading.current_thread():
        # this rank ends on the line: its watch thread polls no more (a poll in flight when the store's host ended
        # printed torch's C++ warning and stack after the rank's last line; CI, a rank that published its failure)
        watch[0].set()
        watch[1].join(timeout=15)
    _count_and_wait(client, f"{key}/known", world, together=True, ranks=ranks)


_count_lock = threading.Lock()


def _count_and_wait(store, counter: str, world: int, wait: bool = True, together: bool = False,
                    ranks: list[int] | None = None) -> None:
    """Count this process under `counter` in the launch's store, once (a watch thread and the main thread may both
    count it), then, with `wait`, wait at most HOST_WAIT_SECONDS until all `world` ranks have: a process whose end
    may end the store lets every rank read what it holds first. Each rank counts by setting its own key
    (`COUNTER/RANK`), which a try repeated after a store hiccup (`_read`) sets again, not twice: an `add` that
    failed may have been applied. Counted in one try, a hiccup there left the rank uncounted and the store's host
    waiting the whole bound for it (a hiccup in the wait ended the host's wait early). A store that is gone (its
    host ended): nothing left to wait for. `ranks`: the only ranks waited for (None: all)."""
    clients, keys = [store], [f"{counter}/{r}" for r in range(world)]
    waited = keys if ranks is None else [keys[r] for r in ranks]
    try:
        with _count_lock:
            # a frozenset, replaced: a copy of `state.run` keeps its own
            if counter not in state.run.get("counted", ()):
                state.run["counted"] = state.run.get("counted", frozenset()) | {counter}
                rank = int(os.environ.get("RANK", "0"))
                _read(clients, lambda c: c.set(keys[rank], "1"))
        deadline = time.monotonic() + timing.HOST_WAIT_SECONDS
        # every rank of a failed launch waits here, polling the one store
        if wait:
            counted = _all_set(lambda k: _read(clients, lambda c: c.check([k])), waited, deadline)
            if together:
                _left_together(clients, counter, world, rank=int(os.environ.get("RANK", "0")), counted=counted,
                               ranks=ranks)
    except Exception:  # noqa: BLE001 - the store is gone (its host ended): nothing left to wait for
        pass


def _left_together(clients: list, counter: str, world: int, rank: int, counted: bool,
                   ranks: list[int] | None = None) -> None:
    """After the wait for every rank to count under `counter` (`_count_and_wait`; `counted`: all did): a rank that
    does not host the store says it stopped waiting and calls the store no more (also when its wait ran out: the
    host waits for its word); a process whose exit may end the store (`_ends_store`: its host, or under torchrun
    a worker of the node whose agent serves it), where all counted, waits at most HOST_WAIT_SECONDS more until
    each of the others has. Before, the host ended the store as soon as it saw every rank counted, while a rank
    still polling to see the same got its connection reset: torch's C++ warning and stack after that rank's last
    line (CI, seen once); under torchrun, before that rank's error line (CI: node 0's worker exited at once, its
    agent with it). That bound is its own: shared with the wait for the counts, a last rank counted near its end
    left the host one look at the others' words before it ended the store under a rank still polling. `ranks`:
    the only ranks waited for (None: all)."""
    if not _hosts_store():
        _read(clients, lambda c: c.set(f"{counter}/left/{rank}", "1"))
    if _ends_store() and counted:
        others = [f"{counter}/left/{r}" for r in (range(world) if ranks is None else ranks) if r != rank]
        _all_set(lambda k: _read(clients, lambda c: c.check([k])), others, time.monotonic() + timing.HOST_WAIT_SECONDS)


def _all_set(is_set: Callable[[str], bool], keys: list[str], deadline: float) -> bool:
    """Poll until every one of `keys` is set in the launch's store (`is_set(key)`), or `deadline`; whether all
    were. Keys 0..seen-1 are set (a key once set stays): each poll asks one key at a time from the first not yet
    seen, not all of them (every rank of a launch may poll the one store: at 512 ranks, 10 polls/s of 512 keys
    each kept the store's one thread busy)."""
    seen = 0
    while True:
        while seen < len(keys) and is_set(keys[seen]):
            seen += 1
        if seen == len(keys):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(timing.POLL_SECONDS / 5)
