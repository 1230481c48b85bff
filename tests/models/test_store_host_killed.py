"""A rank waiting on the launch's store (rank 0's resize-bucket, `main_alone`; the watch thread's polls) when the
process serving it is killed (rank 0 of a plain env:// launch, `kill -9`): it ends on its one line, without torch's
C++ warnings (models/collective/canary.py `store_host_gone`). Before, each thread's next call through torch's client on
the connection the dead host had closed printed c10d's "recvValue failed ... Connection reset by peer" and a C++ stack
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
        done = f"{collective.store_client._launch_key('done')}/resize-bucket"
        waiting, watching = [collective.store_client._store_client()], [collective.store_client._store_client()]
        assert not collective.reconnect._read(waiting, lambda c: c.check([done]))  # rank 0 still works
        host.kill()
        host.wait(timeout=TIMEOUT)
        with pytest.raises(dist.DistNetworkError) as lost:  # what becomes the rank's one line (`lost_peer_line`)
            collective.reconnect._read(waiting, lambda c: c.check([done]))
        assert collective.lost_peer_line(lost.value) is not None
        # the watch thread's next round (run here: no call of another thread in flight) ends the watch quietly
        keys = collective.store_client
        collective.watch._watch(watching, keys._failure_key(), threading.Event(), keys._alive_key(1))
        assert collective.state.run.get("store_lost")  # its exit counts nothing in the store that is gone
    finally:
        host.kill()
        host.wait()
    err = capfd.readouterr().err
    assert "[c10d]" not in err and "frame #" not in err, err[-3000:]


def test_a_store_seen_gone_is_that_runs_alone_and_its_canary_closed_at_the_end(monkeypatch, own_collective):
    """A store host seen gone was remembered by address for the process life: a later run of the same process given
    the same port by its launch (tests; a notebook) found every wait failed at once ("the store's process ended").
    Now what `store_host_gone` learnt belongs to the run's store: forgotten when a run sets its store up, and its
    canary closed when the run is done with it (`_stop_watching`). The first store is a plain listening socket
    that is closed with the canary still in its backlog (a reset: no TIME_WAIT holding the port); the second is
    torch's, on that port, reached as rank 1 of a torchrun launch."""
    import socket

    from test_launch_devices import _env

    collective = own_collective
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in _env(1, port, agent_store=True).items():
        monkeypatch.setenv(name, value)
    assert not collective.store_host_gone()  # the canary waits in the listener's backlog: alive
    listener.close()  # the first run's store host ended
    assert collective.store_host_gone()
    from datetime import timedelta

    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    collective.before_group._before_group_store(TIMEOUT)  # the next run's store, at the same address
    assert not collective.store_host_gone(), "the next run's store was taken for the first one's, gone"
    collective.watch_failures(2)
    assert not collective.store_host_gone()  # its canary made (here, or by the watch thread's first poll)
    canary = collective.state.run["canaries"][("127.0.0.1", str(port))]
    assert canary and canary.fileno() >= 0
    collective.state.run["stop_watching"]()  # the run's end
    assert canary.fileno() == -1, "the canary stayed open after the run"
    del store
