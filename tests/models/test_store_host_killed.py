"""A rank waiting on the launch's store (rank 0's resize-bucket, `main_alone`; the watch thread's polls) when the
process serving it is killed (rank 0 of a plain env:// launch, `kill -9`): it ends on its one line, without torch's
C++ warnings (models/collective.py `store_host_gone`). Before, each thread's next call through torch's client on the
connection the dead host had closed printed c10d's "recvValue failed ... Connection reset by peer" and a C++ stack
before it raised: two of them before the rank's line. The host here is a process of its own, killed before either
call (no call in flight: an ordering, not a timing); this process plays rank 1."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from own_collective import own_collective  # noqa: F401  (the fixture)
from test_launch_devices import TIMEOUT

HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
print(store.port, flush=True)
time.sleep(600)
"""


def test_a_rank_whose_store_host_was_killed_ends_without_torchs_warnings(monkeypatch, own_collective, capfd):
    collective = own_collective
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    try:
        port = host.stdout.readline().strip()
        for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}.items():
            monkeypatch.setenv(name, value)
        done = f"{collective._launch_key('done')}/resize-bucket"
        waiting, watching = [collective._store_client()], [collective._store_client()]
        assert not collective._read(waiting, lambda c: c.check([done]))  # rank 0 still works
        host.kill()
        host.wait(timeout=TIMEOUT)
        with pytest.raises(dist.DistNetworkError) as lost:  # what becomes the rank's one line (`lost_peer_line`)
            collective._read(waiting, lambda c: c.check([done]))
        assert collective.lost_peer_line(lost.value) is not None
        # the watch thread's next round (run here: no call of another thread in flight) ends the watch quietly
        collective._watch(watching, collective._failure_key(), threading.Event(), collective._alive_key(1))
        assert collective._state.get("store_lost")  # its exit counts nothing in the store that is gone
    finally:
        host.kill()
        host.wait()
    err = capfd.readouterr().err
    assert "[c10d]" not in err and "frame #" not in err, err[-3000:]
