"""A launched process's exit: its process group closed, bounded (`close_at_exit`), and its last use of the launch's
store (`_count_exit`)."""

from __future__ import annotations

import atexit
import os
import threading

from models.collective import state, timing
from models.collective.canary import store_host_gone
from models.collective.counting import _count_and_wait
from models.collective.report import report_once
from models.collective.store_client import _hosts_store, _launch_key, _store_client


def close_at_exit() -> None:
    """Close this process's process group (`destroy_process_group`) when it exits, once, after a launcher made one.
    Left to the interpreter's finalization, gloo's worker threads may still hold finished work whose tensors need
    the GIL to be freed: the process then aborts (SIGABRT) after its last line, a failed rank's exit 1 becoming -6
    (seen in CI; pytorch/pytorch#179291), and NCCL warns at every exit that the group was never destroyed. Closing
    waits for the group's pending work; a peer stuck in a collective could hold it for the collective timeout, so
    after CLOSE_SECONDS the process ends with status 1 and one line."""
    if state.run.get("closing"):
        return
    state.run["closing"] = True
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
    if not closed.wait(timing.CLOSE_SECONDS):
        report_once(f"this rank's process group did not close within {timing.CLOSE_SECONDS:.0f} s at exit (another "
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
    if state.run.get("store_done"):
        return
    if state.run.get("store_lost") or state.run.get("store_silent"):
        if store_host_gone():
            return
        try:
            client = _store_client(timing.PROBE_SECONDS)
        except Exception:  # noqa: BLE001 - silent or gone still: this rank is not counted
            return
    _count_and_wait(client, _launch_key("exited"), world, wait=_hosts_store())
