"""A launched rank stopped by a Ctrl-C before its first exchange publishes its stop through the launch's store
(models/collective.py `publish_interrupt`). Where the store's host accepts connections but never answers (stopped
by SIGSTOP, hung), torch's client ignores its timeout: the rank printed its stop line and then never exited, a
second Ctrl-C and a SIGTERM both ignored (the main thread blocked in one C++ call), only SIGKILL ended it. Now the
connect runs in a thread of its own, waited for within our bound: the rank says in one line that it could not tell
the others and exits 130; a SIGTERM during that wait ends it at once (143). One process of its own per case,
started warm (tests/warm_start.py), against a plain listening socket that never answers."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from warm_start import WarmProcess

RANK_SCRIPT = Path(__file__).with_name("rank_frozen_store.py")
BOUND = 30.0  # generous, for a loaded machine; before the fix neither case ended within any bound


def _silent_store() -> socket.socket:
    """A port that accepts connections (the kernel's handshake, as for a stopped process) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    return listener


def _rank_1(port: int, connect_seconds: float) -> WarmProcess:
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    return WarmProcess([sys.executable, str(RANK_SCRIPT), str(connect_seconds)], env=env)


def _wait_ready(proc: WarmProcess) -> None:
    deadline = time.monotonic() + BOUND
    while "ready" not in proc.output()[0]:
        assert proc.poll() is None, proc.output()
        assert time.monotonic() < deadline, "the rank never started its command"
        time.sleep(0.05)


@pytest.mark.parametrize("then", ["nothing", "sigterm"])
def test_a_ctrl_c_against_a_store_that_never_answers_still_ends_the_rank(then) -> None:
    listener = _silent_store()
    port = listener.getsockname()[1]
    # "nothing": a short bound, the exit comes once it ran out; "sigterm": a long one, which the SIGTERM cuts short
    proc = _rank_1(port, 2.0 if then == "nothing" else 3600.0)
    try:
        _wait_ready(proc)
        proc.send_signal(signal.SIGINT)
        if then == "sigterm":
            deadline = time.monotonic() + BOUND
            while "stopped by SIGINT" not in proc.output()[1]:  # its stop line: it is publishing now
                assert proc.poll() is None and time.monotonic() < deadline, proc.output()
                time.sleep(0.05)
            time.sleep(0.5)  # inside the publish's connect (a wait of its own, not a race: any moment of it works)
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(BOUND)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: the defect
            pytest.fail(f"the rank did not end within {BOUND:.0f} s of its Ctrl-C ({then}): {proc.output()}")
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()
    out, err = proc.output()
    assert "Traceback" not in err, err
    assert "stopped by SIGINT (Ctrl-C)" in err, err
    if then == "nothing":
        assert proc.returncode == 130, (proc.returncode, err)
        assert err.rstrip().endswith(f"rank 1 could not tell the other ranks at 127.0.0.1:{port} "
                                     "within 2 s (the store's host accepts connections but does not answer: stopped "
                                     "or hung); they stop at their own timeout"), err
    else:
        assert proc.returncode == 143, (proc.returncode, err)
