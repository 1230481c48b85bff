"""The watch thread (`watch_failures`, `_watch`): when another rank publishes a failure (`fails_alone`), it prints that
line and ends this process with status 1, wherever the main thread is (a collective included), and it counts this
rank alive in the store every HEARTBEAT_SECONDS; while the ranks train in lockstep, it also ends them on a peer
frozen there (`_frozen`, models/collective/frozen.py). `new_run` forgets what an earlier run in this process left."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

from models.collective import frozen, state, timing
from models.collective.canary import forget_store_hosts, store_host_gone
from models.collective.counting import _known_by_all
from models.collective.exit import _count_exit
from models.collective.reconnect import _reconnect
from models.collective.report import _bar_mid_line, report_once
from models.collective.store_client import _agent_store, _alive_key, _call, _failure_key, _store_client
from schemas.interruptible import received


def new_run() -> None:
    """Forget what an earlier run in this process left (a test's in-process `main()`, a notebook's second command):
    its watch thread stopped (its exit's work, `_stop_watching`, done now), and the watch state, the arrivals and
    before-group exchanges counted, the before-group store and the report lock started afresh, as the signal record
    is (schemas/interruptible.py `record_signals`). Before, `watching` stayed set: the second run started no watch
    thread, so a peer failing in it was not seen (its line, its stop), and a lock kept by the first run's report
    silenced the second's lines. The process group's close at exit (`close_at_exit`) is the process's, kept."""
    stop = state.run.get("stop_watching")
    if stop is not None:
        stop()
    forget_store_hosts()
    closing = state.run.get("closing", False)
    state.run.clear()
    state.run.update(state.fresh(), closing=closing)
    state.before.update(state.fresh_before())
    state.report_lock = threading.Lock()


def watch_failures(world: int) -> None:
    """Start this process's watch thread (once): when another rank publishes a failure (`fails_alone`), print its
    line and end this process with status 1, wherever the main thread is (a collective included). Started by the
    first agreement, or before the process group by the first exchange through the store (`gather_before_group`)."""
    if world <= 1 or state.run["watching"]:
        return
    state.run["watching"], state.run["world"] = True, world
    forget_store_hosts()  # this run's store: what an earlier one at the same address did says nothing of it
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return  # a launch naming no store: failures are only agreed on (`together`)
    try:
        client = _store_client()
    except Exception:  # noqa: BLE001 - not within CONNECT_SECONDS (two unanswered reverse DNS lookups)
        # the watch thread tries again (`_watch`): given up here, this live rank counted no sign of life, and the
        # ranks waiting for it (`arrive_together`) named it as killed; a failure published by another went unseen
        client = None
        state.run["store_lost"] = True  # its exit tries the store only briefly (`_count_exit`)
    stop = threading.Event()
    alive = _alive_key(int(os.environ.get("RANK", "0")))
    clients = [client]  # the watch thread's connection, replaced after a failed call (`_reconnect`)
    watcher = threading.Thread(target=_watch, args=(clients, _failure_key(), stop, alive), name="rank-failure-watch",
                               daemon=True)
    watcher.start()

    def _stop_watching() -> None:
        # Stopped and joined before the interpreter finalizes: a daemon thread still inside the store client's
        # C++ call then is killed mid-call, which aborted a finished rank (SIGABRT, seen once in CI).
        if stop.is_set():  # stopped already (the exit after a test's own stop)
            return
        stop.set()
        watcher.join(timeout=15)
        _count_exit(clients[0], world)
        forget_store_hosts()  # the run's last use of its store: its canaries closed

    atexit.register(_stop_watching)
    state.run["stop_watching"], state.run["watcher"] = _stop_watching, (stop, watcher)


def _watch(clients: list, key: str, stop: threading.Event, alive: str | None = None) -> None:
    """The watch thread: counts this rank alive every HEARTBEAT_SECONDS and polls the failure key every
    POLL_SECONDS through `clients[0]`, its own connection. A failed call is not yet the end of the launch (a store
    busy past the client's timeout, a dropped connection): it connects again (`_reconnect`). Before, one failed call
    ended the thread, and with it this live rank's signs of life: the ranks waiting for it in `arrive_together`
    stopped the launch LOST_SECONDS later, naming it as killed. No connection yet (`watch_failures`' first one
    failed): made here first, as after a failed call; a store that does not answer then is said in one line."""
    if clients[0] is None and not _reconnect(clients, stop):
        if not stop.is_set():
            _unwatched_warning()
        return
    beat, look, seen = 0.0, 0.0, {}  # `_frozen`'s next look and what it saw of the peers' signs of life
    while not stop.is_set():
        client = clients[0]
        if store_host_gone():  # no call: torch's client would print a C++ warning and stack for it
            state.run["store_lost"] = True
            return
        try:
            # bounded (`_call`): a store whose host stopped answering held this thread for ever, and this rank's exit
            # waited for it (`_stop_watching`), then counted itself in that store (`_count_exit`)
            if alive is not None and time.monotonic() >= beat:  # this rank's sign of life (`arrive_together`)
                _call(client, lambda c: c.add(alive, 1))
                beat = time.monotonic() + timing.HEARTBEAT_SECONDS
            if _call(client, lambda c: c.check([key])):
                break
            if time.monotonic() >= look:
                look = time.monotonic() + timing.LIVENESS_SECONDS
                _frozen(client, key, seen)
        except Exception:  # noqa: BLE001 - a hiccup, the store gone (its host ended: the launch is over) or silent
            if not _connect_again(clients, stop):
                if state.found.silent:
                    _store_host_frozen(stop)
                return
            beat = 0.0  # a sign of life at once: the outage took some of the waiting ranks' LOST_SECONDS
            continue
        stop.wait(timing.POLL_SECONDS)
    else:
        return  # the process is exiting normally
    if state.run["published"]:  # this rank failed: its main thread reports (and cleans up)
        return
    try:
        message = _call(client, lambda c: c.get(key)).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - the store went away meanwhile: the main thread meets the others' exit
        return
    _known_by_all(client, key, state.run["world"])  # before the exit: it may end this node's store
    if received(signal.SIGINT):  # the same Ctrl-C reached this rank (a terminal's, every rank's): its own stop
        _stopped_here(stop)
        return
    if report_once(message):
        os._exit(1)  # the main thread may be inside a collective that never returns


def _connect_again(clients: list, stop: threading.Event) -> bool:
    """`_reconnect` until the store answers (True). A store out of reach past STORE_RETRY_SECONDS (a switch
    rebooting: its port does not answer a connect) is tried on: a watch thread that ended there counted no more
    signs of life for this live rank, whom the others then named frozen (`_frozen`) or lost (`arrive_together`),
    and saw no failure they published. False where the store is gone (its port refuses: its host ended), where it
    accepted but never answered for as long (its host stopped, hung: each such try leaves a connect blocked), or
    where this process exits (`stop`)."""
    while True:
        state.found.silent = None  # this round's finding (`_outcome`)
        if _reconnect(clients, stop):
            return True
        if state.found.gone or state.found.silent or store_host_gone() or stop.wait(timing.POLL_SECONDS):
            return False


def _store_host_frozen(stop: threading.Event) -> None:
    """The store stopped answering (it accepts connections: its host stopped or hung) while this rank trains in
    lockstep. Where rank 0 serves it (a plain env:// launch, `_agent_store` not) a frozen rank 0 silences its own
    signs of life with the store, so no peer's look (`_frozen`) could name it, and the ranks waited in the
    all-reduce for the process group's timeout: once this rank's steps have stalled for LOST_SECONDS too, it ends
    with rank 0's frozen line, said by each rank itself (no store to publish it through). Steps that go on never
    stall that long; training that ends first (out of lockstep) ends this wait."""
    if _agent_store() or not frozen.stalled(0.0):
        return
    while not stop.wait(timing.POLL_SECONDS):
        if not frozen.stalled(0.0):  # out of lockstep: no collective waits for rank 0 here
            return
        if frozen.stalled(timing.LOST_SECONDS):
            report_once(frozen.frozen_line([0], state.run["world"]))
            os._exit(1)  # the main thread waits in a collective that never returns


def _frozen(client, key: str, seen: dict[int, tuple[int, float]]) -> None:
    """While this rank trains in lockstep and has waited longer than a step's parts take (LIVENESS_SECONDS): the
    peers' signs of life watched (`frozen.frozen_peers`); once it has waited LOST_SECONDS with a peer silent as
    long, that peer's line is published and this process ends on it (its main thread waits in a collective the
    frozen peer never joins). Otherwise what was seen is forgotten: a later wait judges afresh."""
    if not frozen.stalled(timing.LIVENESS_SECONDS):
        seen.clear()
        return
    world, me = state.run["world"], int(os.environ.get("RANK", "0"))
    lost = frozen.frozen_peers(lambda op: _call(client, op), world, me, seen)
    if not lost or not frozen.stalled(timing.LOST_SECONDS):
        return
    line = _call(client, lambda c: c.compare_set(key, "", frozen.frozen_line(lost, world))).decode("utf-8", "replace")
    state.run["published"] = True
    _known_by_all(client, key, world, [r for r in range(world) if r not in lost])
    report_once(line)
    os._exit(1)  # the main thread waits in a collective that never returns


def _stopped_here(stop: threading.Event) -> None:
    """The watch thread of a rank that a Ctrl-C reached too, having read another rank's line for the same Ctrl-C
    (every rank of a terminal's gets it at once; the first to publish names itself): this rank ends as a Ctrl-C
    ends it, exit 130 with its own line, from its main thread (`stop` is set by its exit). Before, a rank whose
    main thread had not run its handler yet (inside a collective's C++ call, or simply later) printed the peer's
    line and exited 1. A main thread still not exiting after CLOSE_SECONDS (a collective that never returns:
    NCCL's waits for its timeout) is ended here as it would end: its line where no launcher says it, 130."""
    deadline = time.monotonic() + timing.CLOSE_SECONDS
    while not stop.wait(timing.POLL_SECONDS):
        if not threading.main_thread().is_alive():  # the interpreter's exit is under way: its line said
            return
        if time.monotonic() > deadline:
            break
    else:
        return
    if not os.environ.get("TORCHELASTIC_RUN_ID"):  # as the CLI's own line: under torchrun its agent says it
        cli = sys.modules.get("pipeline.cli")
        line = cli.stopped_line(sys.argv[1:]) if cli is not None else "stopped by SIGINT (Ctrl-C)"
        sys.stderr.write(("\n" if _bar_mid_line() else "") + line + "\n")
        sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


def _unwatched_warning() -> None:
    """Said once by a rank whose watch thread never reached the launch's store: nothing else would say it, and
    the ranks that wait for this one may later name it as lost."""
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    text = (f"warning: rank {os.environ.get('RANK', '?')} could not reach the launch's store at {where} within "
            f"{timing.CONNECT_SECONDS + timing.STORE_RETRY_SECONDS:.0f} s: it does not watch the other ranks (a "
            "failure of another rank stops it only at the next agreement) and counts no sign of life, so ranks "
            f"waiting for it name it as lost after {timing.BEFORE_GROUP_SECONDS:.0f} s; see the launcher's log and "
            "this node's DNS")
    sys.stderr.write(("\n" if _bar_mid_line() else "") + text + "\n")
    sys.stderr.flush()
