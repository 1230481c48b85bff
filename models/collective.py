"""Decisions every rank takes together: a step that can fail on one rank (a checkpoint write on a full disk, a
damaged input, a threshold) is run inside `together(...)`, and afterwards every rank knows whether any rank
failed; if one did, every rank raises the same one-line `UserError` (the lowest failing rank's message), so all
ranks exit within seconds with the same line instead of one rank dying and the others waiting at the next
barrier until the collective timeout (torchtune all-reduces its decisions the same way).

Only integers and UTF-8 bytes travel (two small collectives: an all-reduce of the failing rank, a broadcast of
its message); no pickled objects. With one process nothing is exchanged and the error passes through as it is.

Work during which the other ranks may sit in a collective this rank will never join cannot be agreed on in
place: DDP all-reduces the gradients inside the last backward, so a rank that runs out of memory in its forward
or backward leaves the others waiting there (NCCL: until the collective timeout). Such work runs in
`fails_alone(...)`: an error is written, as its one line, to the launcher's key-value store (the TCPStore at
MASTER_ADDR:MASTER_PORT that torchrun / accelerate set up, through a connection of our own), and every other
rank's watch thread (`watch_failures`), which polls that key, prints the same line and ends its process with
status 1 at once, even from inside a collective. Such a rank ends like a killed process: what it wrote is
resumable (shards, checkpoints are committed by rename), its read lease names a dead process (gc ignores it)
and its file locks go with the process. The failing rank itself unwinds normally and prints the line.

What the process group is made of (its backend: NCCL on GPUs, gloo on CPUs) cannot be agreed on through the
group itself: `gather_before_group` exchanges every rank's text through the same store before any group exists
(models/launch_devices.py decides the device from it). Its first exchange starts the watch thread: a rank that
fails alone before the group (the CLI publishes an error no handler made a line of: `rank_error_line`) stops
the ranks waiting for it at their next exchange, instead of after BEFORE_GROUP_SECONDS (30 minutes); one that
fails before its own first exchange publishes too, where the store is surely up (`_publish_unwatched`).
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import select
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from schemas.errors import UserError
from schemas.interruptible import received

if TYPE_CHECKING:
    import torch

# torch is imported in the functions that exchange tensors or reach the launcher's store, not here: one process
# never calls them, and every command's error line comes through here (pipeline/commands/common.py
# `user_errors`): `store inspect` of a wrong path paid torch's import (seconds, ~650 MB) for its one line

MESSAGE_BYTES = 2048  # the broadcast message's fixed size (a one-line error; longer ones are cut)


T = TypeVar("T")


class RankFailed(UserError):
    """Another rank (or this one) failed a step all ranks take together; the message is that rank's error."""


POLL_SECONDS = 0.5  # how often a watch thread asks the store whether a rank failed alone
HEARTBEAT_SECONDS = 2.0  # how often a watch thread counts its rank alive in the store (`arrive_together`)
HOST_WAIT_SECONDS = 10.0  # how long a rank that ends on a published failure waits for every rank to have read it


def _device() -> torch.device:
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(message: str | None, world: int) -> str | None:
    """Every rank's view of the step: None when every rank succeeded, else the lowest failing rank's message."""
    import torch
    import torch.distributed as dist

    rank, dev = dist.get_rank(), _device()
    first = torch.tensor([rank if message is not None else world], dtype=torch.int64, device=dev)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    src = int(first.item())
    if src == world:
        return None
    buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=dev)
    if rank == src:
        data = message.encode("utf-8", "replace")[:MESSAGE_BYTES]
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    dist.broadcast(buf, src=src)
    return bytes(buf.cpu().numpy()).rstrip(b"\0").decode("utf-8", "replace")


def _message(error: BaseException, what: str) -> str:
    if isinstance(error, UserError):
        text = str(error)
    else:
        text = f"{what or 'a step'} failed: {type(error).__name__}: {error}"
    return " ".join(text.splitlines()) or type(error).__name__


def agreed(error: BaseException | None) -> bool:
    """Whether every rank already knows of this error (it came out of `together` or `share_failure`, or
    `failure_line` published it)."""
    return isinstance(error, RankFailed) or getattr(error, "agreed_by_all_ranks", False)


def _mark(error: BaseException) -> BaseException:
    try:
        error.agreed_by_all_ranks = True  # type: ignore[attr-defined]
    except AttributeError:  # an exception type with __slots__: it is then reported as any other
        pass
    return error


@contextmanager
def together(world: int, what: str = "", uneven: bool = False) -> Iterator[None]:
    """Run the block on every rank, then agree: an exception on any rank becomes the same `RankFailed` on every
    rank. A `UserError` keeps its message; any other exception is named by type (and re-raised with its
    traceback on the rank where it happened: a bug is still a bug). `what` names the step in that message.
    Also a barrier: no rank leaves before every rank has run the block.
    `uneven`: the ranks may come to the agreement far apart (each ends its own share of the work there, or one
    rank works alone in the block): they wait for each other through the launcher's store first
    (`arrive_together`), not inside the agreement's collective, whose timeout (NCCL's: 10 minutes) would end
    the ranks that came early. Only for a block with no collective inside: a rank failing before one would wait
    at the arrival for ranks that wait for it in that collective."""
    if world <= 1:
        yield
        return
    watch_failures(world)  # from the first agreement on, a rank that fails alone stops this one too
    error: BaseException | None = None
    try:
        yield
    except KeyboardInterrupt as e:  # on this rank alone: the others would wait for it at the agreement
        _tell_interrupt(e, world, what)
        raise
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        if agreed(e):  # a nested agreement already told every rank
            raise
        error = e
    if uneven:
        arrive_together(world, what)
    message = _agree(None if error is None else _message(error, what), world)
    if message is None:
        return
    if error is not None and not isinstance(error, UserError):
        raise _mark(error)
    raise RankFailed(message) from None


def all_max(world: int, values: list[int]) -> list[int]:
    """Each value's maximum over every rank (integers only, like everything here); one process: `values`."""
    return _all_reduce(world, values, "MAX")


def spread(world: int, values: list[int]) -> list[tuple[int, int]]:
    """Each value's (highest, lowest) over every rank, from one all-reduce of the values and their negations: a
    value is the same on every rank where the two are equal. One process: (value, value)."""
    out = all_max(world, [x for v in values for x in (v, -v)])
    return [(high, -neg_low) for high, neg_low in zip(out[0::2], out[1::2])]


def differing_ranks(world: int, digests: list[str]) -> list[list[int]]:
    """For each hex digest (a fingerprint, a sha256), the ranks whose digest is not rank 0's ([]: the same on every
    rank), the same lists on every rank, so a refusal can name the ranks: one all-gather of every rank's digests
    (`gather_texts`). One process: none differs."""
    if world <= 1:
        return [[] for _ in digests]
    text = " ".join(digests)
    if len(text) > MESSAGE_BYTES:  # a bug of the caller, not a configuration to refuse
        raise ValueError(f"{len(digests)} digests of {len(text)} characters in all: at most {MESSAGE_BYTES}")
    ranks = [t.split(" ") for t in gather_texts(world, text)]
    return [[r for r in range(1, world) if ranks[r][i:i + 1] != ranks[0][i:i + 1]] for i in range(len(digests))]


def ranks_differ(ranks: list[int]) -> str:
    """`differing_ranks`' ranks for a line: "rank 1 differs from rank 0", "ranks 1, 3 differ from rank 0"."""
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank {shown} differs from rank 0" if len(ranks) == 1 else f"ranks {shown} differ from rank 0"


def gather_texts(world: int, text: str, size: int | None = MESSAGE_BYTES) -> list[str]:
    """Every rank's `text` (UTF-8, cut at `size` bytes), in rank order, on every rank: one all-gather of fixed-size
    byte buffers, so every rank can take the same decision from the same data. `size` None: each text whole, the
    buffers as long as the longest (agreed by an all-reduce first: a text cut short, as JSON, read as none). One
    process: [text]."""
    if world <= 1:
        return [text]
    import torch
    import torch.distributed as dist

    dev = _device()
    data = text.encode("utf-8", "replace")
    if size is None:
        size = max(1, all_max(world, [len(data)])[0])
    data = data[:size]
    buf = torch.zeros(size, dtype=torch.uint8, device=dev)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [bytes(b.cpu().numpy()).rstrip(b"\0").decode("utf-8", "replace") for b in bufs]


def all_sum(world: int, values: list[int]) -> list[int]:
    """Each value's sum over every rank (integers only); one process: `values`."""
    return _all_reduce(world, values, "SUM")


def _all_reduce(world: int, values: list[int], op: str) -> list[int]:
    if world <= 1:
        return list(values)
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return [int(v) for v in t.tolist()]


def share_failure(world: int, error: BaseException | None, what: str = "") -> None:
    """The failure path of a rank that left the steps it shares with the others (an error in its own part of
    the work): publish it through the launcher's store, so the other ranks stop at once with this message
    (their watch threads, below) instead of finishing their share first; without a store, take part in the one
    agreement the other ranks reach next (`together`). Nothing to do for one process, no error, or an agreed
    one."""
    if world <= 1 or error is None or agreed(error) or not isinstance(error, Exception):
        return
    message = _message(error, what)
    if _publish(message, world) is None:  # no store: the others learn it at their next agreement
        _agree(message, world)
    _mark(error)


# ---------------------------------------------------------------------------------------------- failing alone

def _fresh_state() -> dict:
    return {"watching": False, "published": False}


_state: dict = _fresh_state()
_report_lock = threading.Lock()
# `silent`: the line of this thread's last store call (`_outcome`) where it went unanswered, else None
_found = threading.local()


def new_run() -> None:
    """Forget what an earlier run in this process left (a test's in-process `main()`, a notebook's second command):
    its watch thread stopped (its exit's work, `_stop_watching`, done now), and the watch state, the arrivals and
    before-group exchanges counted, the before-group store and the report lock started afresh, as the signal record
    is (schemas/interruptible.py `record_signals`). Before, `watching` stayed set: the second run started no watch
    thread, so a peer failing in it was not seen (its line, its stop), and a lock kept by the first run's report
    silenced the second's lines. The process group's close at exit (`close_at_exit`) is the process's, kept."""
    global _report_lock
    stop = _state.get("stop_watching")
    if stop is not None:
        stop()
    forget_store_hosts()
    closing = _state.get("closing", False)
    _state.clear()
    _state.update(_fresh_state(), closing=closing)
    _before.update(_fresh_before())
    _report_lock = threading.Lock()


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
        if _state.get("store_silent"):  # unbounded in place: not against a store found silent (the exit's retry)
            done["error"] = StoreSilent(_state["store_silent"])
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
        _state["store_silent"] = _found.silent = _silent_line(where, seconds)
        raise StoreSilent(_found.silent)
    if isinstance(done.get("error"), StoreSilent):  # not asked (`_in_thread` at shutdown): silent still
        _found.silent = str(done["error"])
        raise done["error"]
    _state.pop("store_silent", None)  # it answered (again)
    _found.silent = None
    if "error" in done:
        raise done["error"]
    return done["value"]


def _again_timeout(timeout: float) -> float:
    """The timeout of a new connection (`_store_client`) for a rank's later use of the store (a publish, a peer's
    line, the exit's count): PROBE_SECONDS where a call found it silent (`store_silent`), `timeout` else. Such a
    store is tried once more, briefly, not skipped: the flag is cleared only by a later call answered, and a stall
    that had passed would have cost the rank its word to the others."""
    return PROBE_SECONDS if _state.get("store_silent") else timeout


def _silent_line(where: str, seconds: float) -> str:
    return (f"the launch's store at {where} accepts connections but did not answer within {seconds:.0f} s (its host "
            "is stopped, hung or unreachable)")


def _bound(client) -> float:
    """How long one call through `client` is given (`_outcome` waits a second more): its own timeout (10 s when it
    has none), STORE_RETRY_SECONDS at most (the before-group store's is 30 minutes, its calls answer at once)."""
    held = getattr(client, "timeout", None)
    return min(held.total_seconds() if isinstance(held, timedelta) else 10.0, STORE_RETRY_SECONDS)


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
            socket.create_connection((host, int(port)), timeout=max(min(PROBE_SECONDS, left), 0.01)).close()
            # the port answers: the store's own client, given CONNECT_SECONDS (milliseconds on an idle host)
            client = _connect(host, int(port), max(min(CONNECT_SECONDS, left), 0.01), pending)
        except (OSError, RuntimeError) as e:  # refused (not up yet), no answer, a name not resolved yet; DistError
            if time.monotonic() + POLL_SECONDS > deadline:
                if isinstance(e, StoreSilent):
                    raise StoreSilent(_silent_line(f"{host}:{port}", timeout)) from None
                last = (str(e).splitlines() or [type(e).__name__])[0][:200]
                raise TimeoutError(f"no store answered at {host}:{port} within {timeout:.0f} s, the last try: "
                                   f"{last}") from None
            time.sleep(POLL_SECONDS)
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


def watch_failures(world: int) -> None:
    """Start this process's watch thread (once): when another rank publishes a failure (`fails_alone`), print its
    line and end this process with status 1, wherever the main thread is (a collective included). Started by the
    first agreement, or before the process group by the first exchange through the store (`gather_before_group`)."""
    if world <= 1 or _state["watching"]:
        return
    _state["watching"], _state["world"] = True, world
    forget_store_hosts()  # this run's store: what an earlier one at the same address did says nothing of it
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return  # a launch naming no store: failures are only agreed on (`together`)
    try:
        client = _store_client()
    except Exception:  # noqa: BLE001 - not within CONNECT_SECONDS (two unanswered reverse DNS lookups)
        # the watch thread tries again (`_watch`): given up here, this live rank counted no sign of life, and the
        # ranks waiting for it (`arrive_together`) named it as killed; a failure published by another went unseen
        client = None
        _state["store_lost"] = True  # its exit tries the store only briefly (`_count_exit`)
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
    _state["stop_watching"], _state["watcher"] = _stop_watching, (stop, watcher)


CLOSE_SECONDS = 60.0  # how long an exiting rank waits for its process group to close (a peer stuck mid-collective)


def close_at_exit() -> None:
    """Close this process's process group (`destroy_process_group`) when it exits, once, after a launcher made one.
    Left to the interpreter's finalization, gloo's worker threads may still hold finished work whose tensors need
    the GIL to be freed: the process then aborts (SIGABRT) after its last line, a failed rank's exit 1 becoming -6
    (seen in CI; pytorch/pytorch#179291), and NCCL warns at every exit that the group was never destroyed. Closing
    waits for the group's pending work; a peer stuck in a collective could hold it for the collective timeout, so
    after CLOSE_SECONDS the process ends with status 1 and one line."""
    if _state.get("closing"):
        return
    _state["closing"] = True
    exiting, closed = threading.Event(), threading.Event()
    # Started now, idle until the exit: Python 3.12.0-3.12.1 refuse to start a thread in an atexit callback
    # ("can't create new thread at interpreter shutdown"), which left the group to finalization again. A Python
    # thread waiting on Events (never inside a C++ call), joined at exit: nothing left at finalization.
    deadline = threading.Thread(target=_close_deadline, args=(exiting, closed), name="process-group-close-deadline",
                                daemon=True)
    deadline.start()
    atexit.register(_close_process_group, exiting, closed, deadline)


def _close_deadline(exiting: threading.Event, closed: threading.Event) -> None:
    exiting.wait()
    if not closed.wait(CLOSE_SECONDS):
        report_once(f"this rank's process group did not close within {CLOSE_SECONDS:.0f} s at exit (another "
                    "rank is stuck in a collective): ending this process")
        os._exit(1)


def _close_process_group(exiting: threading.Event, closed: threading.Event, deadline: threading.Thread) -> None:
    import torch.distributed as dist

    exiting.set()
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a group whose peers are gone: exiting anyway, its error was reported
        pass
    finally:
        closed.set()
        deadline.join()


def _agent_store() -> bool:
    """Is the launch's store a launcher agent's (torchrun), which ends when its node's workers exit?"""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _hosts_store() -> bool:
    """Does this process serve the launch's store? Rank 0 of a plain env:// launch does (torch's rendezvous, or
    `_before_group_store`); under torchrun the node's agent does."""
    return os.environ.get("RANK") == "0" and not _agent_store()


def _count_exit(client, world: int) -> None:
    """This process's last use of the launch's store, once its watch thread has stopped: counted, and the store's
    host waits (at most HOST_WAIT_SECONDS) until every rank has counted before its exit ends the store. Before, a
    rank whose exit came later (a loaded node) had its watch thread poll a store already gone: torch's client
    printed a C++ warning and stack after the rank's last line (CI: rank 1 of an agreed refusal). Not after a
    store found gone (a client call prints that warning again) nor after a published failure, whose ranks all end
    once they know it (`_known_by_all`): a host waiting here would redraw its progress bar after its line. Where
    a call went unanswered or the store was being tried again (`store_silent`, `store_lost`: a stall at the watch
    thread's last poll, its `_reconnect` cut short by this exit), one new connection given PROBE_SECONDS
    (as `_again_timeout`), unless the store's host is gone (`store_host_gone`): a store that answers it counts this
    rank. Skipped there, a rank the stall had passed was never counted, and the host waited for it its whole bound."""
    if _state.get("store_done"):
        return
    if _state.get("store_lost") or _state.get("store_silent"):
        if store_host_gone():
            return
        try:
            client = _store_client(PROBE_SECONDS)
        except Exception:  # noqa: BLE001 - silent or gone still: this rank is not counted
            return
    _count_and_wait(client, _launch_key("exited"), world, wait=_hosts_store())


def _alive_key(rank: int) -> str:
    return f"{_launch_key('alive')}/{rank}"


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
    beat = 0.0
    while not stop.is_set():
        client = clients[0]
        if store_host_gone():  # no call: torch's client would print a C++ warning and stack for it
            _state["store_lost"] = True
            return
        try:
            # bounded (`_call`): a store whose host stopped answering held this thread for ever, and this rank's exit
            # waited for it (`_stop_watching`), then counted itself in that store (`_count_exit`)
            if alive is not None and time.monotonic() >= beat:  # this rank's sign of life (`arrive_together`)
                _call(client, lambda c: c.add(alive, 1))
                beat = time.monotonic() + HEARTBEAT_SECONDS
            if _call(client, lambda c: c.check([key])):
                break
        except Exception:  # noqa: BLE001 - a hiccup, the store gone (its host ended: the launch is over) or silent
            if not _reconnect(clients, stop):
                return
            beat = 0.0  # a sign of life at once: the outage took some of the waiting ranks' LOST_SECONDS
            continue
        stop.wait(POLL_SECONDS)
    else:
        return  # the process is exiting normally
    if _state["published"]:  # this rank failed: its main thread reports (and cleans up)
        return
    try:
        message = _call(client, lambda c: c.get(key)).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - the store went away meanwhile: the main thread meets the others' exit
        return
    _known_by_all(client, key, _state["world"])  # before the exit: it may end this node's store
    if received(signal.SIGINT):  # the same Ctrl-C reached this rank (a terminal's, every rank's): its own stop
        _stopped_here(stop)
        return
    if report_once(message):
        os._exit(1)  # the main thread may be inside a collective that never returns


def _stopped_here(stop: threading.Event) -> None:
    """The watch thread of a rank that a Ctrl-C reached too, having read another rank's line for the same Ctrl-C
    (every rank of a terminal's gets it at once; the first to publish names itself): this rank ends as a Ctrl-C
    ends it, exit 130 with its own line, from its main thread (`stop` is set by its exit). Before, a rank whose
    main thread had not run its handler yet (inside a collective's C++ call, or simply later) printed the peer's
    line and exited 1. A main thread still not exiting after CLOSE_SECONDS (a collective that never returns:
    NCCL's waits for its timeout) is ended here as it would end: its line where no launcher says it, 130."""
    deadline = time.monotonic() + CLOSE_SECONDS
    while not stop.wait(POLL_SECONDS):
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
            f"{CONNECT_SECONDS + STORE_RETRY_SECONDS:.0f} s: it does not watch the other ranks (a failure of "
            "another rank stops it only at the next agreement) and counts no sign of life, so ranks waiting for it "
            f"name it as lost after {BEFORE_GROUP_SECONDS:.0f} s; see the launcher's log and this node's DNS")
    sys.stderr.write(("\n" if _bar_mid_line() else "") + text + "\n")
    sys.stderr.flush()


STORE_RETRY_SECONDS = 30.0  # how long a store that stopped answering is tried again: well under LOST_SECONDS
PROBE_SECONDS = 2.0  # how long one try waits for the store's port to accept a connection
# How long torch's client may take to connect once the port answered a probe: milliseconds, but 5 s where one of
# its reverse DNS lookups went unanswered (the resolver's timeout: torch names each connection's peer, in the
# client's connect and on the store's one thread; a probe's handshake is the kernel's, at once): a 2 s try timed
# out in CI, printing c10d's error and stack at a rank's start (docs/architecture.md, bench/store_connect.py). One
# C++ call that no signal ends, hence bounded: a store that accepted the probe and then went away costs this once.
CONNECT_SECONDS = 10.0


def _reconnect(clients: list, stop: threading.Event) -> bool:
    """After a failed call through `clients[0]`: a new connection there once the store answers again (True), or
    False where the store is gone - nothing listens on its port any more (its host ended: at once), or it did not
    answer for STORE_RETRY_SECONDS - or `stop` is set (this process exits). A new connection, as after a timeout
    the old one's late answer would be read as the next call's. Each try first opens a plain socket to the port:
    torch's client, trying a store that is gone, prints a C++ warning and stack each time (after a rank's last
    line, where its exit came after the host's). Meanwhile, and for good when False, the exit does not count
    itself in the store (`_count_exit`)."""
    _state["store_lost"] = True
    host, port = os.environ.get("MASTER_ADDR"), int(os.environ.get("MASTER_PORT") or 0)
    if not host or not port:
        return False
    deadline, pause = time.monotonic() + STORE_RETRY_SECONDS, POLL_SECONDS
    held = getattr(clients[0], "timeout", None)  # None: no connection yet (`_watch`)
    timeout = held.total_seconds() if isinstance(held, timedelta) else 10.0  # `_store_client`'s default
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
        except ConnectionRefusedError:
            return False  # the store's host ended: the launch is over
        except OSError:
            pass  # no answer yet (a loaded host, a network blip)
        else:
            try:
                # the timeout the replaced connection had for every later call (PROBE_SECONDS made a store busy for
                # 3 s, which the first connection waited out, fail each call through the new one)
                clients[0] = _store_client(timeout)
                _state["store_lost"] = False
                return True
            except Exception:  # noqa: BLE001 - the port answers, the store not yet: try again
                pass
        stop.wait(pause)
        pause = min(2 * pause, HEARTBEAT_SECONDS)
    return False


def _read(clients: list, read: Callable[[object], T]) -> T:
    """`read(client)` through `clients[0]` for a main thread's long wait (`arrive_together`, `main_alone`: hours),
    tried again on a new connection after a failed call (`_reconnect`): one hiccup of the store ended the rank in a
    traceback, and the launch with it. Reads only, or writes that are the same when applied twice (a `set`, a
    compare-and-set): a call that failed may have been applied. A store gone: its failure, as before. Each call is
    bounded (`_call`): against a store whose host stopped answering (SIGSTOP, hung) it blocked for ever, a Ctrl-C
    ignored; a store still silent after `_reconnect`'s tries ends the wait in one line (`StoreSilent`): those tries'
    own finding (`_found`, this thread's), not the process's, which the watch thread's poll answered meanwhile clears.
    A batch of calls (one or two per rank: `_lost_ranks`) is one `_read` per call, each bounded and tried again on
    its own: one bound for the whole batch ran out on a busy store of many ranks, and the batch was tried again for
    ever."""
    while True:
        if store_host_gone():
            import torch.distributed as dist

            # what the failed call would have raised (its one line: `lost_peer_line`), without torch's C++ warning
            raise dist.DistNetworkError("Connection closed by peer: the launch's store's process ended")
        try:
            return _call(clients[0], read)
        except Exception as e:  # noqa: BLE001 - re-raised below when the store does not answer again
            bound = _bound(clients[0])
            if not _reconnect(clients, threading.Event()):
                if not isinstance(e, StoreSilent) and getattr(_found, "silent", None):
                    # its tries connected and got no answer: said so, whatever the first call raised (torch's timeout)
                    raise StoreSilent(_silent_line(_where(), bound)) from None
                raise


_canary_lock = threading.Lock()


def forget_store_hosts() -> None:
    """Close this process's canaries (`store_host_gone`) and forget the store hosts it saw gone: the state of one
    run's store, not of its address for the process life. Called when a run sets up its store (its first exchange,
    `_before_group_store`; its watch, `watch_failures`) and when it is done with it (`_stop_watching`, at its exit).
    Before, a host seen gone stayed gone for that address: a later run of a long-lived process (tests; a notebook)
    given the same port by the next launch found every wait failed at once; and the canaries stayed open."""
    with _canary_lock:
        for canary in _state.get("canaries", {}).values():
            if canary:  # False: none could be made; None: closed already
                canary.close()
        _state["canaries"], _state["hosts_gone"] = {}, set()


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
        canaries, gone = _state.setdefault("canaries", {}), _state.setdefault("hosts_gone", set())
        if where in gone:
            return True
        canary = canaries.get(where)
        if canary is False:  # could not be made: the calls say what they meet, as before
            return False
        if canary is None:
            try:
                # tried once (each poll of a long wait comes here; a port that does not answer costs PROBE_SECONDS)
                canary = socket.create_connection((where[0], int(where[1])), timeout=PROBE_SECONDS)
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
            socket.create_connection((where[0], int(where[1])), timeout=PROBE_SECONDS).close()
            return False
        except ConnectionRefusedError:
            gone.add(where)
            return True
        except OSError:  # no answer (a loaded host, a network blip): the calls say what they meet
            return False


def report_once(message: str) -> bool:
    """Print `error: MESSAGE` to stderr (red on a terminal, as the CLI's lines) unless this process already
    reported a failure; whether it printed. Every failure line of a launched rank comes here - its main thread's
    (the CLI's handlers: pipeline/commands/common.py `report_error`), its watch thread's, a signal's - because two
    of them may print at once: where every rank met the same failure, a rank's watch thread read the line another
    rank published while its main thread printed its own, the same (the user saw it twice). While watching, the
    lock is kept: the process ends after its report, and a second reporter stays silent. In one process it is
    released: nothing else reports there, and another command may follow in the same process (tests)."""
    if not _report_lock.acquire(blocking=False):
        return False
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        text = ("\n" if _bar_mid_line() else "") + f"error: {message}"
        try:
            red = sys.stderr.isatty()
        except (OSError, ValueError):
            red = False
        sys.stderr.write((f"\x1b[31m{text}\x1b[0m" if red else text) + "\n")
        sys.stderr.flush()
    finally:
        if not _state["watching"]:
            _report_lock.release()
    return True


def _bar_mid_line() -> bool:
    """Whether a progress bar may have left stderr mid-line, so a line printed now must start with a newline: a
    bar still open (this rank's main thread is stuck in its loop), or one another thread is closing (tqdm drops a
    bar from its open ones before it writes its last state and newline: the clean CI run's one failure, rank 0's
    line glued to its bar's text). Not merely tqdm imported (every rank imports it with the libraries): a rank
    that drew no bar printed a blank line before the error."""
    tq = sys.modules.get("tqdm.std")
    if tq is None:
        return False
    if len(getattr(tq.tqdm, "_instances", ())):  # open bars (tqdm keeps no disabled bar there)
        return True
    closing, me = tq.tqdm.close.__code__, threading.get_ident()
    for ident, frame in sys._current_frames().items():  # the closing bar is on another thread's stack
        while ident != me and frame is not None:
            if frame.f_code is closing:
                return True
            frame = frame.f_back
    return False


def publish_failure(message: str, world: int) -> str:
    """Tell every rank's watch thread that this rank failed with `message`; the line every rank prints (the
    first one published, when several ranks fail at once). Without a store, `message` itself."""
    line = _publish(message, world)
    return message if line is None else line


def _publish(message: str, world: int) -> str | None:
    """`publish_failure`, or None when no store could be reached (nothing published)."""
    if not _state["watching"]:
        return None
    return _write_failure(message, world)


def _write_failure(message: str, world: int, timeout: float = 10.0, watching_only: bool = False) -> str | None:
    """Write `message` under the launch's failure key unless a line is there already (that one is returned), then
    wait for the ranks to read it (`_known_by_all`); None when no store could be reached in `timeout` seconds.
    `watching_only`: wait only for the ranks watching already (`_watching_ranks`), for a publisher that cannot
    know whether any rank waits for it (one stopped before its own first exchange)."""
    _state["published"] = True
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


def _untold_warning(silent: str) -> None:
    """The line of a rank whose failure or stop could not be published: the store's host accepts connections but
    does not answer (stopped, hung; `silent`: `StoreSilent`'s text), so the ranks waiting for this one learn nothing
    from it."""
    sys.stderr.write(("\n" if _bar_mid_line() else "") + f"rank {os.environ.get('RANK', '?')} could not tell the other "
                     f"ranks: {silent}; they stop at their own timeout\n")
    sys.stderr.flush()


def _watching_ranks(call: Callable, world: int) -> list[int]:
    """The other ranks whose watch thread has counted a sign of life (`_alive_key`): those that may wait for this
    one (a rank waiting at an exchange or an arrival watches from its first exchange on) and read a line it
    publishes within POLL_SECONDS. A rank with none is still starting: it reads the line at its first exchange, if
    the store is still up, and no wait here would make it read sooner. `call(op)`: one store call (`_read`)."""
    me = int(os.environ.get("RANK", "0"))
    return [r for r in range(world) if r != me and call(lambda c: c.add(_alive_key(r), 0)) > 0]


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
    _state["store_done"] = True
    watch = _state.get("watcher")
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
            if counter not in _state.get("counted", ()):  # a frozenset, replaced: a copy of `_state` keeps its own
                _state["counted"] = _state.get("counted", frozenset()) | {counter}
                rank = int(os.environ.get("RANK", "0"))
                _read(clients, lambda c: c.set(keys[rank], "1"))
        deadline = time.monotonic() + HOST_WAIT_SECONDS
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
    host waits for its word); the host, where all counted, waits at most HOST_WAIT_SECONDS more until each of them
    has. Before, the host ended the store as soon as it saw every rank counted, while a rank still polling to see
    the same got its connection reset: torch's C++ warning and stack after that rank's last line (CI, seen once).
    That bound is its own: shared with the wait for the counts, a last rank counted near its end left the host
    one look at the others' words before it ended the store under a rank still polling. `ranks`: the only ranks
    waited for (None: all)."""
    if not _hosts_store():
        _read(clients, lambda c: c.set(f"{counter}/left/{rank}", "1"))
        return
    if counted:
        others = [f"{counter}/left/{r}" for r in (range(world) if ranks is None else ranks) if r != rank]
        _all_set(lambda k: _read(clients, lambda c: c.check([k])), others, time.monotonic() + HOST_WAIT_SECONDS)


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
        time.sleep(POLL_SECONDS / 5)


def peer_failure() -> str | None:
    """The line another rank published, if any (for a main thread that met a collective error first: a peer's
    exit closes the gloo connections)."""
    if not _state["watching"]:
        return None
    try:
        client = _store_client(_again_timeout(10.0))
        if client is not None and _call(client, lambda c: c.check([_failure_key()])):
            line = _call(client, lambda c: c.get(_failure_key())).decode("utf-8", "replace")
            _known_by_all(client, _failure_key(), _state["world"])  # this rank ends on it
            return line
    except Exception:  # noqa: BLE001
        pass
    return None


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


def out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, (torch.OutOfMemoryError, MemoryError))


@contextmanager
def fails_alone(world: int, what: str, oom_advice: str = "") -> Iterator[None]:
    """Run this rank's own part of a step (its data, its forward and backward) where the other ranks may be
    inside a collective it will not join: an error is published to every rank (see the module doc) and raised
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
    if not _state["watching"]:
        _publish_unwatched_interrupt(error)
        return
    if store_host_gone():
        return
    _tell_interrupt(error, _state["world"], "")


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
        socket.create_connection((host, int(port)), timeout=PROBE_SECONDS).close()
    except (OSError, ValueError):  # not up (or not answering): nobody reads it there now
        return
    _write_failure(_interrupt_line(os.environ.get("RANK", "?"), ""), world, CONNECT_SECONDS, watching_only=True)
    _mark(error)


def _one_agents_ranks(world: int) -> bool:
    """Whether every rank of the launch is a worker of this node's torchrun agent (one node): this rank's exit
    makes the agent stop every other rank at once (it restarts or ends the whole group), and a Ctrl-C's line is
    the agent's (pipeline/commands/launch.py), so a stop before the first exchange has no one to tell. Its exit
    then imports no torch and connects to no store: a terminal's Ctrl-C reaches every rank and the agent, which
    waits for its ranks' exits, and each rank's took seconds (a second Ctrl-C needed)."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID")) and os.environ.get("LOCAL_WORLD_SIZE") == str(world)


def failure_line(error: BaseException, line: str) -> str:
    """The line a process prints at its top level for `error` (one-line text `line`). With several ranks, an error
    the others do not know of yet is published first (they stop with it), and a line published before (another
    rank's failure, of which this error may be a consequence) wins, so every rank prints the same."""
    if agreed(error) and _state.get("stop_watching") is not None:
        # every rank knows and is about to exit: nothing left to watch for, and a poll of a store whose host
        # (rank 0) exited first logged a C++ stack after this line (its last line was no longer the error)
        _state["stop_watching"]()
    if agreed(error):
        return line
    if not _state["watching"]:
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


# How long a rank that failed before its first exchange tries to reach the store. Not 5 s: a connect took over 5 s
# once in CI (an unanswered reverse DNS lookup in torch's connect: CONNECT_SECONDS), nothing was published, and the
# ranks waiting for this one waited BEFORE_GROUP_SECONDS (30 minutes). A store that is not up (a plain env://
# launch whose rank 0 never came) delays this exit that long.
UNWATCHED_STORE_SECONDS = 30.0


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
    published = _write_failure(line, world, UNWATCHED_STORE_SECONDS)
    return line if published is None else published


def rank_error_line(error: BaseException) -> str:
    """The line the other ranks print for an error this rank did not expect (a bug, a broken install on its node),
    which ends this process in its traceback: `rank N: TypeName: message`, so they name the rank to look at."""
    text = " ".join(f"{type(error).__name__}: {error}".splitlines())
    return f"rank {os.environ.get('RANK', '?')} failed: {text} (its traceback is in that rank's output)"


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
        time.sleep(POLL_SECONDS)
    _count_and_wait(clients[0], f"{key}/seen", world, wait=False)
    return None


LOST_SECONDS = 120.0  # a rank waited for whose watch thread has counted no sign of life for this long is gone
LIVENESS_SECONDS = 5.0  # how often a waiting rank looks at the signs of life of the ranks not arrived
WAIT_NOTICE_SECONDS = 600.0  # how often a long wait says who it waits for (`_wait_notice`)


def arrive_together(world: int, what: str) -> None:
    """Wait until every rank has come here, through the launcher's store: however long the others still work
    (an encoder's share that ends an hour after another's, a commit rank 0 makes alone), where a collective would
    have ended this rank at its timeout (NCCL's: 10 minutes; the agreement that follows then finds every rank
    there). A rank that fails meanwhile stops this one through its watch thread, as anywhere; a rank killed
    without a word (its watch thread's signs of life, `HEARTBEAT_SECONDS`, stop) stops every waiting rank after
    LOST_SECONDS with one line naming it; one that never gave any (still starting) after BEFORE_GROUP_SECONDS.
    Without a store (a launch naming none): nothing (the collective waits). Every rank calls it as often, in the
    same order: the arrivals are numbered per process (`what`, which may name a rank's own path, only names the
    step in the line)."""
    if world <= 1 or not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return
    watch_failures(world)
    try:
        client = _store_client()
    except Exception as e:  # noqa: BLE001 - never skipped alone: the others would wait here for this rank
        raise UserError(f"{what}: the ranks wait for each other through the launch's store at "
                        f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}, which this rank cannot reach "
                        f"({_first_line(e)}): see the launcher's log") from None
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    _state["arrivals"] = _state.get("arrivals", 0) + 1
    key = f"{_launch_key('arrived')}/{_state['arrivals']}"
    _call(client, lambda c: c.set(f"{key}/{rank}", "1"))
    _call(client, lambda c: c.add(key, 1))  # bounded, not tried again (`_read`): an add applied twice counts two
    seen: dict[int, tuple[int, float]] = {}  # rank -> (its signs of life, when they last changed here)
    look, began = 0.0, time.monotonic()
    notice = began + WAIT_NOTICE_SECONDS
    clients = [client]
    while _read(clients, lambda c: c.add(key, 0)) < world:
        if time.monotonic() >= notice:
            notice += WAIT_NOTICE_SECONDS
            line = _wait_notice(lambda op: _read(clients, op), key, world, rank, time.monotonic() - began, what)
            if line:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
        if time.monotonic() >= look:
            look = time.monotonic() + LIVENESS_SECONDS
            lost = _lost_ranks(lambda op: _read(clients, op), key, world, seen)
            if lost:
                from models.agreement import few

                line = (f"{what}: rank(s) {few(lost)} of {world} gave no sign of life for {LOST_SECONDS:.0f} s while "
                        "the others waited for them (killed: `kill -9`, the out-of-memory killer - `dmesg` on its "
                        "node says - or its node lost); what the ranks committed is kept: rerun the same command "
                        "to continue")
                raise RankFailed(publish_failure(line, world))
        time.sleep(POLL_SECONDS)


def _wait_notice(call: Callable, key: str, world: int, rank: int, waited: float, what: str) -> str | None:
    """The line a long wait prints (every WAIT_NOTICE_SECONDS), by the lowest rank arrived only (one line, not one
    per rank): a rank alive but stuck (a hung network file system read) keeps counting signs of life, so the
    others wait on without an end; the line says who they wait for, so a user sees it and can stop the job.
    `call(op)`: one store call (`_read`)."""
    arrived = [r for r in range(world) if call(lambda c: c.check([f"{key}/{r}"]))]
    if not arrived or arrived[0] != rank:
        return None
    from models.agreement import few

    missing = [r for r in range(world) if r not in arrived]
    return (f"{what}: {len(arrived)} of {world} ranks have waited {waited / 60:.0f} min for rank(s) {few(missing)}, "
            "still alive (working, or stuck: its node's logs say which)")


def _lost_ranks(call: Callable, key: str, world: int, seen: dict[int, tuple[int, float]]) -> list[int]:
    """The ranks not arrived at `key` whose signs of life have not changed for LOST_SECONDS; a rank that never gave
    any (its watch thread not started yet, or unable to reach the store) only after BEFORE_GROUP_SECONDS: a rank
    still starting is no lost one, but no wait is for ever. `call(op)`: one store call (`_read`)."""
    now, lost = time.monotonic(), []
    for r in range(world):
        if call(lambda c: c.check([f"{key}/{r}"])):
            continue
        beats = call(lambda c: c.add(_alive_key(r), 0))
        if r not in seen or seen[r][0] != beats:
            seen[r] = (beats, now)
        elif now - seen[r][1] > (LOST_SECONDS if beats else BEFORE_GROUP_SECONDS):
            lost.append(r)
    return lost


# ------------------------------------------------------------------------------------------ before the group

# How long a rank waits for the others' texts before the process group exists: as long as torch's own
# rendezvous would wait for them (its default process-group timeout), so no launch that would have formed a
# group is refused for its ranks starting far apart (a node still pulling its image).
BEFORE_GROUP_SECONDS = 1800.0
def _fresh_before() -> dict:
    return {"store": None, "hosted": False, "count": {}}


_before: dict = _fresh_before()


def gather_before_group(world: int, what: str, text: str, timeout: float | None = None) -> list[str]:
    """Every rank's `text`, in rank order, on every rank, before any process group exists, so that all ranks can
    decide together what the group is made of (its backend): through the launcher's store, under keys of this
    launch attempt and of `what` (the decision, e.g. train.device; every rank calls it as often with the same
    `what`). A rank waits for the others at most `timeout` seconds (BEFORE_GROUP_SECONDS), then refuses naming
    those that never came.
    Without a launcher's store (a plain env:// launch: a platform set WORLD_SIZE, RANK, MASTER_*), rank 0 serves
    the store, and the process group later serves from it too. One process, or a launch that names no store
    (then no env:// group can form either): [text], this rank's alone."""
    if world <= 1 or not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return [text]
    from models.agreement import few

    timeout = BEFORE_GROUP_SECONDS if timeout is None else timeout
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store = _before_group_store(timeout)
    except Exception as e:  # noqa: BLE001 - the store's own error (a timeout, a refused connection, a taken port)
        raise UserError(f"{what}: the ranks decide it together through the launch's store at {where}, but none "
                        f"could be reached ({_first_line(e)}): launch with `pipeline launch` (torchrun)") from None
    # from the first exchange on, a rank that fails alone before the group (between two of these, or before the
    # group forms) ends this one with its line, wherever it waits (here: else until `timeout`, 30 minutes)
    watch_failures(world)
    rank = int(os.environ.get("RANK", "0"))
    count = _before["count"][what] = _before["count"].get(what, 0) + 1
    key = f"{_launch_key('before-group')}/{what}/{count}"
    keys = [f"{key}/{r}" for r in range(world)]
    try:
        # each call bounded (`_call`): a store whose host stopped answering held this wait for ever, a Ctrl-C ignored
        _call(store, lambda c: c.set(keys[rank], text))
        _wait_keys(store, keys, timeout)
        texts = [_call(store, lambda c: c.get(k)).decode("utf-8", "replace") for k in keys]
    except Exception as e:  # noqa: BLE001 - timed out (DistStoreError), or the store went away: named below
        if isinstance(e, StoreSilent):
            raise UserError(f"{what}: the ranks decide it together through the launch's store, but {e}: see that "
                            "host (rank 0's when no launcher serves the store) or the launcher's log") from None
        try:
            missing = [r for r, k in enumerate(keys) if not _call(store, lambda c: c.check([k]))]
        except Exception:  # noqa: BLE001 - the store is gone (its host ended): not the ranks' silence
            missing = []
        if missing:
            raise UserError(f"{what}: the ranks decide it together before training, but rank(s) {few(missing)} of "
                            f"{world} did not report within {timeout:.0f} s: see their logs (a rank that failed "
                            "earlier, or launched with another command)") from None
        # e.g. rank 0 of a plain env:// launch, which serves the store, ended (killed, or failed) meanwhile
        raise UserError(f"{what}: the ranks decide it together through the launch's store at {where}, which "
                        f"went away meanwhile ({_first_line(e)}): see rank 0's log (it serves the store when no "
                        "launcher does) or the launcher's") from None
    # every rank counts itself as having read the texts; the store's host waits for them (the store ends with its
    # process, when the decision is a refusal: the others read first), and so does every rank under an agent's store:
    # the agent ends it once its node's worker exits, and a rank on another node one poll behind met a reset
    # connection instead of the texts (CI: "the launch's store ... went away meanwhile" in place of the refusal)
    _count_and_wait(store, f"{key}/read", world, wait=_before["hosted"] or _agent_store())
    return texts


def _wait_keys(store, keys: list[str], timeout: float) -> None:
    """`store.wait(keys, timeout)`, polled: the store's own wait is one C++ call that no signal ends (a Ctrl-C while
    a rank waited for a rank still starting held it for the whole bound, 30 minutes); between polls the main thread
    runs Python, where a signal's handler runs."""
    if not _all_set(lambda k: _call(store, lambda c: c.check([k])), keys, time.monotonic() + timeout):
        raise TimeoutError(f"the keys were not all set within {timeout:.0f} s")


@contextmanager
def together_before_group(world: int, what: str) -> Iterator[None]:
    """`together` before any process group exists (a check that reads files, at a command's start): the block
    runs on every rank, then every rank's outcome goes to every rank through the launch's store
    (`gather_before_group`), and a failure on any rank becomes the same `RankFailed` on every rank: the lowest
    failing rank's message, named by its rank when some ranks did not fail (a node's own copy of a file). Without
    it, a rank that failed alone there exited while the others went on to wait for it in their first collective
    (on another node: until the collective timeout, saying nothing). One process, or a launch naming no store:
    errors pass through."""
    if world <= 1 or not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        yield
        return
    error: BaseException | None = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        if agreed(e):
            raise
        error = e
    texts = gather_before_group(world, what, "" if error is None else _message(error, what))
    failed = [r for r, text in enumerate(texts) if text]
    if not failed:
        return
    if error is not None and not isinstance(error, UserError):
        raise _mark(error)
    first = texts[failed[0]]
    raise RankFailed(first if len(failed) == world else f"rank {failed[0]}: {first}") from None


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def _before_group_store(timeout: float):
    """This process's connection to the launch's store, made once: a client of the launcher's (torchrun's agent
    store), or, on rank 0 of a launch without one, the store itself, kept for the process life. It is made
    multi-tenant as torch's env:// rendezvous makes rank 0's: the process group then serves from this server
    instead of binding MASTER_PORT a second time."""
    if _before["store"] is None:
        forget_store_hosts()  # a new store (a later run's in this process may have this address)
        # rank 0 of a plain env:// launch serves the store itself; under torchrun the agent does
        if _hosts_store():
            from datetime import timedelta

            import torch.distributed as dist

            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            listener = _ipv4_listener(host, port)
            try:
                _before["store"] = dist.TCPStore(host, port, is_master=True, multi_tenant=True,
                                                 wait_for_workers=False, timeout=timedelta(seconds=timeout), **listener)
            except BaseException:  # its listening socket is ours until a store holds it: the port freed
                if listener:
                    os.close(listener["master_listen_fd"])
                raise
            _before["hosted"] = True
        else:  # waits for a store that is not up yet (rank 0 still starting) as long as for the other ranks
            _before["store"] = _store_client(timeout)
    return _before["store"]


def _ipv4_listener(host: str, port: int) -> dict:
    """`master_listen_fd` for the store this rank serves, where the launch names it by an IPv4 address: a socket
    listening on IPv4, bound as torch binds its own (every interface, the port reusable). torch's own listens on
    IPv6, dual-stack, and names each connection it accepts by a reverse DNS lookup (c10d socket.cpp formats every
    socket's peer with getnameinfo), on the store's one thread: a peer at 127.0.0.1 is then ::ffff:127.0.0.1,
    which /etc/hosts does not answer, so every connection asked the DNS server, and one query left unanswered
    held every rank's calls for the resolver's timeout, 5 s (bench/store_connect.py). Seen on IPv4, the peer is
    named from /etc/hosts where it is there (127.0.0.1 always). An IPv6 address or a host name: torch's own."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return {}
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("", port))
    except OSError:
        # taken: by a store this process still serves there (an earlier run's in the same process, kept by its
        # process group: torch's multi-tenant store serves it again), or by another process (torch's own bind
        # then says "address already in use", the words launchers match): torch's own listener, as before
        listener.close()
        return {}
    return {"master_listen_fd": listener.detach()}  # torch listens on it and closes it with the store
