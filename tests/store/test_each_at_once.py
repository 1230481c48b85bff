"""store.remote.each_at_once: several transfers at a time, the first error stops the queued ones."""

from __future__ import annotations

import threading

import pytest

from store import remote as remote_mod
from store.remote import each_at_once


def test_a_failed_transfer_stops_the_queued_ones_while_an_earlier_one_still_runs(monkeypatch) -> None:
    """A pull whose second object is damaged, while its first (a large shard) still downloads: nothing queued
    after the failure is transferred (pool.map alone went on through the whole version, 500 objects here)."""
    monkeypatch.setattr(remote_mod, "TRANSFERS", 2)
    first_done = threading.Event()
    started_after: list[int] = []

    def transfer(i: int) -> int:
        if i == 0:  # the large transfer: ends once the failure is in (or, unfixed, once the last object went)
            first_done.wait()
            return i
        if i == 1:
            threading.Timer(0.2, first_done.set).start()
            raise ValueError("object 1 is damaged")
        started_after.append(i)
        if i == 499:
            first_done.set()
        return i

    with pytest.raises(ValueError, match="object 1 is damaged"):
        list(each_at_once(transfer, list(range(500))))
    assert started_after == []


def test_results_come_in_order() -> None:
    assert list(each_at_once(lambda i: i * i, list(range(100)))) == [i * i for i in range(100)]
