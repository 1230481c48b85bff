"""A Ctrl-C while training waits for its next prefetched micro-batch (`train.prefetch`, stages/train/prefetch.py)."""

from __future__ import annotations

from signal_elsewhere import run_script

HOLD_SECONDS = 30  # how long the stalled micro-batch holds out: far above what a passing run needs under load

STALLED = f"""
import signal, sys, threading
from types import SimpleNamespace
import torch
from signal_elsewhere import signal_elsewhere_once_main_waits
from stages.train.prefetch import MicroBatches

prepared = threading.Event()

class Stalled(MicroBatches):
    def _make(self):  # the next micro-batch's read stalls (a shard fetched from a URL, a hung network disk)
        threading.Event().wait({HOLD_SECONDS})
        prepared.set()
        return None

tc = SimpleNamespace(check_ahead=0, grad_accum=1)
batches = Stalled(SimpleNamespace(sampler=None), SimpleNamespace(on_damaged="error"), tc, 0, 0,
                  torch.device("cpu"), torch.float32, depth=2)
try:
    signal_elsewhere_once_main_waits("next", signal.SIGINT)
    batches.next()
except KeyboardInterrupt:
    print("interrupted", "after the micro-batch came" if prepared.is_set() else "while it was prepared")
    sys.exit(130)
"""


def test_ctrl_c_ends_training_that_waits_for_a_stalled_micro_batch() -> None:
    """The SIGINT goes to another thread than the main one, as Linux may deliver a Ctrl-C (the prefetch thread
    busy reading takes it as often as not; tests/signal_elsewhere.py): the main thread's untimed `queue.get()`
    never woke for it, and a stalled read held the stop for as long as it stalled."""
    proc = run_script(STALLED, timeout=HOLD_SECONDS + 120)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stdout.strip() == "interrupted while it was prepared"
