"""The encoders' main thread waiting in `ordered_map` for an item being decoded in a worker thread (a slow read of
a remote source, a stuck one): a Ctrl-C (or a launcher's SIGTERM) that Linux gives to another thread ends the
wait (tests/signal_elsewhere.py), as every other wait of the main thread (schemas/interruptible.py). Before: an
untimed `Future.result()` held the main thread until the item ended. Here the item takes HOLD_SECONDS."""

from __future__ import annotations

from signal_elsewhere import run_script

HOLD_SECONDS = 30  # how long the item takes: far above what a passing run needs under load

_WAITING_MAP = """
import os, signal, threading
from concurrent.futures import ThreadPoolExecutor
from signal_elsewhere import signal_elsewhere_once_main_waits
from models.ordered_map import ordered_map

done = threading.Event()

def slow(item):
    done.wait(HOLD_SECONDS)
    done.set()
    return item

pool = ThreadPoolExecutor(1)
try:
    signal_elsewhere_once_main_waits("ordered_map", signal.SIGINT)
    print(list(ordered_map(slow, [1], pool, ahead=1)), "not interrupted")
except KeyboardInterrupt:
    print("interrupted", "after the item" if done.is_set() else "while the item ran")
    os._exit(130)  # the pool's thread would be joined at exit
"""


def test_ctrl_c_elsewhere_ends_a_wait_for_an_item() -> None:
    proc = run_script(f"HOLD_SECONDS = {HOLD_SECONDS}\n" + _WAITING_MAP, timeout=HOLD_SECONDS + 120)
    assert (proc.returncode, proc.stdout.strip()) == (130, "interrupted while the item ran"), proc.stderr[-2000:]
