"""SIGTERM and SIGINT end `pipeline run train` with its read lease released (SIGTERM used to kill the process
before any cleanup, leaving the lease that keeps `store gc` from removing versions)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from store.lease import LEASES_DIR
from train_store import make_train_store, mixed_specs


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_releases_the_read_lease(tiny_edit_model, tmp_path, sig):
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(4, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", "train", "--store", str(store), "--model", tiny_edit_model,
         "--out", str(tmp_path / "run"), "--max-steps", "100000", "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ},
    )
    leases = store / LEASES_DIR
    try:
        # wait for training to have taken its lease (a condition, not a duration: no timing assert)
        while proc.poll() is None and not (leases.is_dir() and any(leases.glob("*.json"))):
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read().decode()
        proc.send_signal(sig)
        out = proc.communicate(timeout=300)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "Traceback" not in out, out
    assert not list(leases.glob("*.json")), out
