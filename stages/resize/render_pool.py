"""resize-bucket's worker processes, with a worker that dies contained to the sample it was rendering.

A worker process can end without an exception: the kernel's out-of-memory killer (several large images decoded
at once), or a crash inside an image library on a hostile file. `concurrent.futures` then breaks the whole pool
(`BrokenProcessPool`, no file named), and a rerun meets the same file again. Here the samples that were in flight
are rendered again one at a time in a single-worker pool: the ones that render are kept (the output is the same
in any process), and a sample whose worker dies even alone is handed to `on_crash` (the stage quarantines it,
naming its files); then a fresh pool takes the rest. Workers that die on several samples in a row, each alone,
stop the run instead (the machine or the environment, not the samples). Written here because no executor in the standard library or
a well-kept package retries per item after a worker death and keeps the results in order with a bounded window.

A Ctrl-C, or a launcher's SIGTERM, ends the stage promptly: the waits for a result are polled (one taken by
another thread of the stage woke the main thread only when the sample at the head was rendered: never, for a
worker stuck on a file), and a stage that stops on an exception ends its workers instead of waiting for their
samples (their results are not used: a rerun renders what was not committed). The workers ignore SIGINT: a
terminal's Ctrl-C, sent to the whole process group, is the stage's to act on (each idle worker printed a
KeyboardInterrupt traceback, and its exit broke the pool mid-stop). From their first instruction: a worker is
started with SIGINT blocked (a thread's signal mask survives fork and exec; a handler would not), and the pool's
initializer then ignores it, which drops one that came during the start-up (it printed a traceback and broke the
pool, or killed the worker before Python had started).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import Callable, Iterable, Iterator, TypeVar

from schemas import interruptible
from schemas.errors import UserError

T = TypeVar("T")
R = TypeVar("R")


def _pool(workers: int) -> ProcessPoolExecutor:
    # spawn: fork would copy a parent holding torch
    return ProcessPoolExecutor(workers, mp_context=_SpawnWithoutSigint(), initializer=_end_with_parent,
                               initargs=(os.getpid(),))


class _ProcessWithoutSigint(SpawnProcess):
    """A spawned process that starts with SIGINT blocked: one that comes before the initializer waits for it. Only
    the starting thread blocks it, for the start: the stage's own Ctrl-C goes to another of its threads meanwhile,
    or waits until then, never lost (as it would be by SIG_IGN in the parent, which the child would inherit too)."""

    def start(self) -> None:
        was = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, was)


class _SpawnWithoutSigint(SpawnContext):
    Process = _ProcessWithoutSigint


PARENT_POLL_SECONDS = 1.0


def _end_with_parent(parent: int) -> None:
    """In each worker: end when the stage's process is gone. A SIGKILLed stage (`kill -9`, the out-of-memory
    killer) otherwise leaves its workers waiting for work forever (re-parented, each holding its memory: seen
    with `concurrent.futures` on Python 3.11). Polled (the parent id changes when the worker is
    re-parented) rather than Linux's PR_SET_PDEATHSIG, which follows the thread that started the worker. Also
    ignores SIGINT (the module's docstring): ignored first, which drops one pending since the start-up, then
    unblocked (`_ProcessWithoutSigint`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def rendered_in_order(fn: Callable[[T], R], items: Iterable[T], workers: int, ahead: int,
                      on_crash: Callable[[T], R]) -> Iterator[tuple[T, R]]:
    """(item, fn(item)) in input order, `fn` run in `workers` spawned processes with at most `ahead` items
    submitted beyond the one handed out (`items` consumed lazily); `workers` 0: inline (nothing to contain)."""
    if workers <= 0:
        for item in items:
            yield item, fn(item)
        return
    source = iter(items)
    window: deque[tuple[T, Future | None]] = deque()
    deaths_in_a_row = 0
    pool = _pool(workers)
    ended = False
    try:
        while True:
            broken = False
            while len(window) <= ahead and not broken:
                item = next(source, _END)
                if item is _END:
                    break
                try:
                    window.append((item, pool.submit(fn, item)))
                except BrokenProcessPool:  # a worker died while this one was being submitted
                    window.append((item, None))
                    broken = True
            if not window:
                ended = True
                return
            if not broken:
                item, fut = window[0]
                try:
                    result = interruptible.result(fut)  # type: ignore[arg-type]
                except BrokenProcessPool:
                    broken = True
                else:
                    window.popleft()
                    deaths_in_a_row = 0
                    yield item, result
                    continue
            pool.shutdown(cancel_futures=True)
            for item, result, died in _one_at_a_time(fn, list(window)):
                deaths_in_a_row = deaths_in_a_row + 1 if died else 0
                if deaths_in_a_row >= DEATHS_IN_A_ROW:
                    raise UserError(
                        f"resize-bucket: a worker process died on {deaths_in_a_row} samples in a row, each rendered "
                        f"alone (the last: {on_crash(item)}): that is the machine or the environment, not the "
                        "samples; check free memory (lower resize.workers or resize.max_image_pixels), or run with "
                        "resize.workers: 0 to see the error")
                yield item, on_crash(item) if died else result  # type: ignore[misc]
            window.clear()
            pool = _pool(workers)
    finally:
        if not ended:  # an exception here or in the consumer (a Ctrl-C, a failed write), or the consumer stopped
            _end_workers(pool)
        pool.shutdown(cancel_futures=True)


def _end_workers(pool: ProcessPoolExecutor) -> None:
    """Terminate `pool`'s worker processes (SIGTERM) and wait until they are gone: `shutdown` alone waits for the
    samples being rendered, a worker stuck on a file forever. `_processes` is the executor's own record of them
    (Python 3.14's `terminate_workers` does the same)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for p in procs:
        try:
            p.terminate()
        except (OSError, ValueError):  # ended already, or closed
            pass
    for p in procs:
        while p.is_alive():
            p.join(interruptible.POLL_SECONDS)


# Samples whose worker dies even alone, one after the other: then the workers cannot work at all (no memory
# left, an environment the spawned process cannot import), and quarantining every sample would hide that.
DEATHS_IN_A_ROW = 3
_END = object()


def _one_at_a_time(fn: Callable[[T], R], entries: list[tuple[T, Future | None]]) -> Iterator[tuple[T, R | None, bool]]:
    """The items that were in flight when a worker died, as (item, result, died): a result that was finished
    before is kept, every other item is rendered alone; a worker that dies then died of that item."""
    solo: ProcessPoolExecutor | None = None
    try:
        for item, fut in entries:
            if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
                yield item, fut.result(), False
                continue
            solo = solo or _pool(1)
            try:
                result = interruptible.result(solo.submit(fn, item))
            except BrokenProcessPool:
                solo.shutdown(cancel_futures=True)
                solo = None
                yield item, None, True
            else:
                yield item, result, False
    except BaseException:
        if solo is not None:
            _end_workers(solo)
        raise
    finally:
        if solo is not None:
            solo.shutdown(cancel_futures=True)
