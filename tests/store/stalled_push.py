"""A `pipeline store push` child that stalls at a point its script picks, once it has said so in a marker file,
and is then SIGKILLed with its process group: a push killed at a known point, without any timing assumption
(tests/store/test_remote_faults.py, test_remote_push_once.py).

The child starts warm (tests/warm_start.py): `pipeline.cli` imports torch, ~9 s of CPU for a cold interpreter.
Its stall and kill are the same: a process of its own (pid, session) that SIGKILL ends without atexit."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import warm_start

HERE = Path(__file__).resolve().parent
STALL_SECONDS = 300  # a generous bound for a loaded machine, not a timing assertion


def push_killed_where_it_stalls(script: str, root: Path, url: str, marker: Path, where: str) -> None:
    """Runs `python -c SCRIPT ROOT URL MARKER` until MARKER exists, then SIGKILLs its group; `where` names the
    stall for the message of a push that never got there."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    child = warm_start.WarmProcess([sys.executable, "-c", script, str(root), url, str(marker)], env=env,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + STALL_SECONDS
        while not marker.exists():
            assert child.poll() is None, f"the push ended before it stalled: {child.output()[1][-2000:]}"
            assert time.monotonic() < deadline, f"the push never reached {where}"
            time.sleep(0.05)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
