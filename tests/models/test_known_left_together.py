"""A published failure's end (models/collective.py `_known_by_all`): every rank counts itself among those that
know the line and waits until all have; the store's host (rank 0 of a plain env:// launch) then ends the store
with its process. Before, it ended as soon as it saw every rank counted, while another rank still polled to see the
same: that rank's poll met a reset connection, and torch's client printed a C++ warning and stack after its last
line (CI: `test_a_failure_published_through_a_store_hiccup_still_stops_every_rank_with_its_line`). Now a rank that
saw all counted says so and calls the store no more; the host waits for those words. Rank-by-rank, in-process,
against a real TCPStore this test serves."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from own_collective import own_collective  # noqa: F401  (the fixture)
from test_launch_devices import TIMEOUT, _env


def _as_rank(monkeypatch, rank: int) -> dist.TCPStore:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    for name, value in _env(rank, store.port, agent_store=False).items():
        monkeypatch.setenv(name, value)
    return store


def test_the_host_ends_only_once_every_rank_saw_all_counted(monkeypatch, own_collective) -> None:  # noqa: F811
    collective = own_collective
    store = _as_rank(monkeypatch, 0)  # rank 0 hosts the store
    key = collective._failure_key()
    store.set(f"{key}/known/1", "1")  # rank 1 counted itself and polls to see rank 0 counted
    returned = threading.Event()
    host = threading.Thread(target=lambda: (collective._known_by_all(collective._store_client(), key, 2),
                                            returned.set()), daemon=True)
    host.start()
    assert not returned.wait(2.0), "the host went on (ending the store) before rank 1 saw every rank counted"
    assert store.check([f"{key}/known/0"])
    store.set(f"{key}/known/left/1", "1")  # rank 1 saw it and calls the store no more
    assert returned.wait(TIMEOUT)


def test_a_rank_that_saw_all_counted_says_so_and_returns(monkeypatch, own_collective) -> None:  # noqa: F811
    collective = own_collective
    store = _as_rank(monkeypatch, 1)
    key = collective._failure_key()
    store.set(f"{key}/known/0", "1")  # the host counted
    collective._known_by_all(collective._store_client(), key, 2)
    assert store.check([f"{key}/known/1", f"{key}/known/left/1"])


def test_a_rank_ending_on_the_line_stops_its_watch_thread_first(monkeypatch, own_collective) -> None:  # noqa: F811
    """Its watch thread polled on until the process ended: a poll in flight when the host ended the store printed
    the same warning (rank 1 of that CI run had published the failure itself)."""
    collective = own_collective
    store = _as_rank(monkeypatch, 1)
    collective.watch_failures(2)
    watcher = next(t for t in threading.enumerate() if t.name == "rank-failure-watch")
    key = collective._failure_key()
    store.set(f"{key}/known/0", "1")
    collective._known_by_all(collective._store_client(), key, 2)
    assert not watcher.is_alive()
