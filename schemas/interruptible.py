"""The main thread's waits for other threads, written so that a Ctrl-C (or a SIGTERM whose handler raises) ends them.

Linux delivers a signal sent to the process (Ctrl-C: to the terminal's whole process group; `kill PID`, a
scheduler's SIGTERM) to any one of its threads that does not block it, often one busy in a system call rather
than the sleeping main thread. CPython's C handler, on whichever thread it runs, only records the signal; the
Python handler (KeyboardInterrupt, the CLI's SystemExit) runs in the main thread the next time that thread runs
bytecode. A main thread blocked in an untimed lock acquire - `Condition.wait()`, `Event.wait()`, `Thread.join()`,
`queue.get()`, `Future.result()` - is woken early only by a signal that interrupts its own system call, so a Ctrl-C
taken by another thread waited until the wait ended by itself: a push stopped after its 120 s upload, a training
run whose prefetch thread was stuck never. Each wait here is a loop of waits of at most `POLL_SECONDS`: the main
thread is back in the interpreter that often, and a recorded signal's handler runs there.

Here because store/, models/ and stages/ all wait this way, and may all import schemas/."""

from __future__ import annotations

import fcntl
import os
import queue
import signal
import threading
import time
from concurrent import futures
from typing import Any, Callable

POLL_SECONDS = 0.1  # how late a signal's handler may run; ten wake-ups a second cost nothing measurable


def wait_until(cond: threading.Condition, done: Callable[[], bool]) -> None:
    """`cond.wait_for(done)`, with `cond` held, as the caller's `while not done(): cond.wait()`."""
    while not done():
        cond.wait(POLL_SECONDS)


def acquire(lock: threading.Lock) -> None:
    """`lock.acquire()`."""
    while not lock.acquire(timeout=POLL_SECONDS):
        pass


def join(thread: threading.Thread) -> None:
    """`thread.join()`."""
    while thread.is_alive():
        thread.join(POLL_SECONDS)


def get(q: queue.Queue) -> Any:
    """`q.get()`."""
    while True:
        try:
            return q.get(timeout=POLL_SECONDS)
        except queue.Empty:
            continue


def result(fut: futures.Future) -> Any:
    """`fut.result()` (not `fut.result(timeout)` in a loop: a TimeoutError the call itself raised would read as
    not done yet)."""
    while not fut.done():
        futures.wait([fut], timeout=POLL_SECONDS)
    return fut.result()


def flock(fd: int) -> None:
    """`fcntl.flock(fd, LOCK_EX)` (another process's lock, or another open file's), as tries that do not block, the
    pause between them growing to POLL_SECONDS: a blocking flock ends early only for a signal delivered to its own
    thread."""
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(pause)
            pause = min(2 * pause, POLL_SECONDS)


# ------------------------------------------------------------------------------- which signals reached the process

_received: dict = {"fd": None, "seen": set(), "write": None}  # the pipe's read end, what it said, its write end
# reentrant: the CLI's signal handlers take it (`note_signal`) on the main thread, between any two bytecodes of it,
# also while that thread holds it in `received` (a plain lock hung the process there for good on a second Ctrl-C)
_received_lock = threading.RLock()


def record_signals() -> None:
    """From now on `received(signum)` tells any thread, at once, whether SIGNUM reached this process: CPython's C
    handler writes each signal's number to the wakeup fd the moment the signal lands, on whichever thread, while
    the Python handler (the CLI's KeyboardInterrupt) runs only once the main thread is back in bytecode - not while
    it waits in a collective's C++ call. Called once by the CLI's entry point (main thread: `set_wakeup_fd` is
    refused elsewhere), after its handlers are installed. A second call (another run in this process: a test's
    in-process `main()`) starts with nothing received and closes the first call's pipe, which before stayed open and
    told that run's signals as the next one's."""
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    with _received_lock:
        earlier = (_received.get("fd"), _received.get("write"))
        _received.update(fd=read, write=write, seen=set())
    for fd in earlier:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:  # closed already (a test's own cleanup)
                pass


def note_signal(signum: int) -> None:
    """Record SIGNUM as received (a Python handler's own record: another wakeup fd may have replaced ours)."""
    with _received_lock:
        _received["seen"].add(int(signum))


def received(signum: int) -> bool:
    """Whether SIGNUM reached this process since `record_signals` (or a handler's `note_signal`)."""
    with _received_lock:
        fd = _received["fd"]
        while fd is not None:
            try:
                data = os.read(fd, 512)
            except OSError:  # nothing more (BlockingIOError), or closed
                break
            if not data:
                break
            _received["seen"].update(data)
        return int(signum) in _received["seen"]
