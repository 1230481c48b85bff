"""The launch's store, reached through connections of our own, every connect and call bounded: the launch's keys
(`_launch_key`), who serves the store (`_hosts_store`, `_agent_store`), the connection (`_store_client`), and the
bounded call (`_call`: `_in_thread`, `_outcome`), which says `StoreSilent` where the store's host accepts
connections but never answers; and every rank's signs of life read at once (`signs_of_life`)."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from typing import Callable, TypeVar

from models.collective import state, timing
from schemas.errors import UserError

T = TypeVar("T")


def _launch_key(kind: str) -> str:
    # One key per launch attempt: torchrun's agent store outlives a restarted attempt (max_restarts).
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"pipeline/{kind}/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _failure_key() -> str:
    return _launch_key("rank-failed")


class StoreSilent(UserError, TimeoutError):
    """The launch's store accepted a connection (or a call) but did not answer within our bound: its host stopped
    (SIGSTOP, a Ctrl-Z on its terminal, a debugger) or hung. torch's client waits for such a store's answer without
    an end, whatever its timeout. A one-line refusal where it ends a command (a rank waiting through the store)."""


def _in_thread(call: Callable[[], T]) -> tuple[threading.Thread | None, dict]:
    """`call()` (a connect or a call of torch's store client) started in a daemon thread; its outcome lands in the
    dict ("value" or "error"), read by `_outcome`. torch's client ignores its timeout against a store whose host
    accepts connections but never answers (its kernel completes the handshake for a stopped process, SIGSTOP, or
    a hung one): run in the main thread, one C++ call blocked it for ever, where no Ctrl-C or SIGTERM ran its
    handler (only SIGKILL ended the rank). A thread left blocked there is a daemon (it never holds the exit). No
    thread (None) where none can start - at the interpreter's shutdown, Python 3.12 refuses one even in an atexit
    handler (the exit's count): the call runs in place, unbounded, as before these threads, unless the store was
    found silent (then `StoreSilent` at once)."""
    done: dict = {}

    def attempt() -> None:
        try:
            done["value"] = call()
        except BaseException as e:  # noqa: BLE001 - raised in the waiting thread (`_outcome`)
            done["error"] = e

    worker = threading.Thread(target=attempt, name="store-call", daemon=True)
    try:
        worker.start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        if state.run.get("store_silent"):  # unbounded in place: not against a store found silent (the exit's retry)
            done["error"] = StoreSilent(state.run["store_silent"])
        else:
            attempt()
        return None, done
    return worker, done


def _outcome(started: tuple[threading.Thread | None, dict], seconds: float, where: str):
    """The outcome of `_in_thread`'s call given `seconds` (the client's timeout), waited for a second more (a wait
    of Python's, which a signal interrupts; where torch's own timeout applies, its error comes first); past that,
    `StoreSilent`."""
    worker, done = started
    if worker is not None:  # (None: run in place, done already)
        worker.join(seconds + 1.0)
    if worker is not None and worker.is_alive():
        # remembered by the process: a Ctrl-C of a rank waiting for it does not wait for it again to publish its stop
        # (any thread's finding); and by this thread, whose wait says so (`_read`) whatever another thread's call
        # met meanwhile (the watch thread's poll answered cleared the process's finding)
        state.run["store_silent"] = state.found.silent = _silent_line(where, seconds)
        raise StoreSilent(state.found.silent)
    if isinstance(done.get("error"), StoreSilent):  # not asked (`_in_thread` at shutdown): silent still
        state.found.silent = str(done["error"])
        raise done["error"]
    state.run.pop("store_silent", None)  # it answered (again)
    state.found.silent = None
    if "error" in done:
        raise done["error"]
    return done["value"]


def _again_timeout(timeout: float) -> float:
    """The timeout of a new connection (`_store_client`) for a rank's later use of the store (a publish, a peer's
    line, the exit's count): PROBE_SECONDS where a call found it silent (`store_silent`), `timeout` else. Such a
    store is tried once more, briefly, not skipped: the flag is cleared only by a later call answered, and a stall
    that had passed would have cost the rank its word to the others."""
    return timing.PROBE_SECONDS if state.run.get("store_silent") else timeout


def _silent_line(where: str, seconds: float) -> str:
    return (f"the launch's store at {where} accepts connections but did not answer within {seconds:.0f} s (its host "
            "is stopped, hung or unreachable)")


def _bound(client) -> float:
    """How long one call through `client` is given (`_outcome` waits a second more): its own timeout (10 s when it
    has none), STORE_RETRY_SECONDS at most (the before-group store's is 30 minutes, its calls answer at once)."""
    held = getattr(client, "timeout", None)
    return min(held.total_seconds() if isinstance(held, timedelta) else 10.0, timing.STORE_RETRY_SECONDS)


def _call(client, call: Callable[[object], T]) -> T:
    """`call(client)`, one call through torch's store client, waited for within `_bound`: `StoreSilent` past that,
    where the call blocked for ever (`_in_thread`)."""
    return _outcome(_in_thread(lambda: call(client)), _bound(client), _where())


def _where() -> str:
    return f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


def _store_client(timeout: float = 10.0):
    """A connection of our own to the launcher's store (a blocked or busy process-group connection is never
    shared with the watch thread); None when the launch named none (MASTER_ADDR / MASTER_PORT). A store not up
    yet (rank 0 still starting) is waited for at most `timeout` seconds, which also bounds every later call.
    The wait is a loop of short tries: torch's client retries inside one C++ call that no signal ends (a Ctrl-C
    or a launcher's SIGTERM held a rank waiting for rank 0 up to BEFORE_GROUP_SECONDS, 30 minutes); each try
    first opens a plain socket to the port, since torch's client prints a C++ warning and stack per failed try.
    The connect itself runs in a thread of its own (`_connect`): against a store whose host accepts but never
    answers (stopped, hung) torch's client waited for ever; a try that got no answer is waited for again (one
    thread per call, not one per try), and at the end `StoreSilent` says so."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    deadline = time.monotonic() + timeout
    pending: list = []  # a connect still waiting for the store's answer, waited for again by the next try
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, int(port)), timeout=max(min(timing.PROBE_SECONDS, left), 0.01)).close()
            # the port answers: the store's own client, given CONNECT_SECONDS (milliseconds on an idle host)
            client = _connect(host, int(port), max(min(timing.CONNECT_SECONDS, left), 0.01), pending)
        except (OSError, RuntimeError) as e:  # refused (not up yet), no answer, a name not resolved yet; DistError
            if time.monotonic() + timing.POLL_SECONDS > deadline:
                if isinstance(e, StoreSilent):
                    raise StoreSilent(_silent_line(f"{host}:{port}", timeout)) from None
                last = (str(e).splitlines() or [type(e).__name__])[0][:200]
                raise TimeoutError(f"no store answered at {host}:{port} within {timeout:.0f} s, the last try: "
                                   f"{last}") from None
            time.sleep(timing.POLL_SECONDS)
            continue
        # a short timeout for the callers' own uses (every call here answers at once, and a store that is gone
        # must not hold an exit for long); theirs, for the before-group exchange's
        client.set_timeout(timedelta(seconds=timeout))
        return client


def _connect(host: str, port: int, seconds: float, pending: list):
    """One try of torch's client to the store at host:port, waited for `seconds` (and a second more: torch's own
    timeout, where it applies, says its error first). A try left waiting (`pending` holds it) is waited for again
    instead of a new one: a store that stays silent leaves one blocked thread behind, not one per try."""
    import torch.distributed as dist

    started = pending[0] if pending else _in_thread(
        lambda: dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=seconds)))
    pending[:] = [started]
    try:
        return _outcome(started, seconds, f"{host}:{port}")
    finally:
        if started[0] is None or not started[0].is_alive():
            pending.clear()


def _agent_store() -> bool:
    """Is the launch's store a launcher agent's (torchrun), which ends when its node's workers exit?"""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _hosts_store() -> bool:
    """Does this process serve the launch's store? Rank 0 of a plain env:// launch does (torch's rendezvous, or
    `_before_group_store`); under torchrun the node's agent does."""
    return os.environ.get("RANK") == "0" and not _agent_store()


def _ends_store() -> bool:
    """May this process's exit end the launch's store? Its host's does (`_hosts_store`); under torchrun the agent
    of the node of group rank 0 serves it (static rendezvous: --node-rank 0; c10d: the store group rank 0's agent
    shares) and ends it once one of that node's workers ended: a worker of that node ends it. Not knowing the node
    (no GROUP_RANK), yes: such a rank waits for the others' words, where the wrong guess ended the store under a
    rank still polling it (torch's C++ warning and stack before that rank's last line; CI, node 1 of a refusal)."""
    return _hosts_store() or (_agent_store() and os.environ.get("GROUP_RANK", "0") == "0")


def _alive_key(rank: int) -> str:
    return f"{_launch_key('alive')}/{rank}"


def signs_of_life(call: Callable, ranks: list[int]) -> list[int]:
    """Each of `ranks`' signs of life (`_alive_key`: its watch thread's count; 0 for one that never counted), in
    two store calls: whether all counters exist (`check`), then all of them at once (`multi_get`), where one call
    per rank would be W - 1 per look of each of W ranks on the launch's one store (512 ranks all waiting: ~52,000
    calls/s; bench/frozen_look.py). Where a counter is missing (a rank still starting) each is read by `add(key, 0)`,
    which makes it for the next look: `multi_get` of a missing key waits for it. `call(op)`: one store call."""
    keys = [_alive_key(r) for r in ranks]
    if not keys:
        return []
    if call(lambda c: c.check(keys)):
        return [int(v) for v in call(lambda c: c.multi_get(keys))]
    return [call(lambda c, k=k: c.add(k, 0)) for k in keys]
