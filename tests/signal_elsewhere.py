"""A signal delivered to a thread other than the main one, once the main thread waits for another thread.

Linux gives a signal sent to the process (Ctrl-C, `kill PID`) to any thread that does not block it; which one
is up to the scheduler, so a test that sends it with os.kill passed or failed by chance (the main thread mostly
gets it when idle). Here it goes to a thread of its own on purpose (`signal.pthread_kill`), and only once the
main thread sits in one of threading's waits (`Condition.wait`, `Event.wait`, `Thread.join`, `queue.get`,
`Future.result` all end there) inside the function under test: a wait that a signal cannot end then fails every
time, never by chance.
For a subprocess's script (put this folder on its PYTHONPATH)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Callable

_WAITS = ("wait", "_wait_for_tstate_lock")  # where every one of those blocks, in threading.py


def main_waits(inside: str) -> bool:
    """Is the main thread blocked in one of threading's waits, called (at any depth) from a function named
    `inside`? (Not any wait: `Thread.start` waits for the new thread too, and that one ends by itself.)"""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None or frame.f_code.co_name not in _WAITS or frame.f_code.co_filename != threading.__file__:
        return False
    while frame is not None and frame.f_code.co_name != inside:
        frame = frame.f_back
    return frame is not None


def main_in_call(inside: str, calls: tuple[str, ...]) -> bool:
    """Is the main thread inside a call (in C: it released the GIL, which this thread holds to look) made at a line
    that reads one of `calls`, called (at any depth) from a function named `inside`? For waits in C code that are
    not threading's (a TCPStore's `wait`, `time.sleep`)."""
    import dis
    import linecache

    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return False
    at = next((i for i in dis.get_instructions(frame.f_code) if i.offset == frame.f_lasti), None)
    if at is None or at.opname != "CALL" or frame.f_lineno is None:
        return False
    if not any(c in linecache.getline(frame.f_code.co_filename, frame.f_lineno) for c in calls):
        return False
    while frame is not None and frame.f_code.co_name != inside:
        frame = frame.f_back
    return frame is not None


def signal_elsewhere_once(ready: Callable[[], bool], signum: int = signal.SIGINT,
                          give_up: float = 60.0) -> threading.Thread:
    """A daemon thread that, once `ready()` holds, sends `signum` to itself (not to the main thread)."""
    def send() -> None:
        deadline = time.monotonic() + give_up
        while not ready():
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        signal.pthread_kill(threading.get_ident(), signum)

    t = threading.Thread(target=send, name="signal-elsewhere", daemon=True)
    t.start()
    return t


def signal_elsewhere_once_main_waits(inside: str, signum: int = signal.SIGINT,
                                     when: Callable[[], bool] = lambda: True) -> threading.Thread:
    """`signal_elsewhere_once` once the main thread waits inside function `inside` and `when()` holds. `when`:
    nothing else will wake the main thread any more (a thread's notify would, and the wait it ends runs the
    handler: the test would pass by that chance)."""
    return signal_elsewhere_once(lambda: when() and main_waits(inside), signum)


def run_script(code: str, timeout: float) -> "subprocess.CompletedProcess[str]":
    """`code` run by a fresh interpreter with the project and this folder importable (the signal must not reach
    pytest's own threads)."""
    import os
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": path})
