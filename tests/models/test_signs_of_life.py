"""Reading every rank's sign of life (models/collective/store_client.py `signs_of_life`) for the frozen-peer check
(frozen.py `frozen_peers`), an arrival's lost ranks (arrive.py `_lost_ranks`) and a publisher's watching ranks
(publish.py `_watching_ranks`), on a real TCPStore the test serves: a peer silent for LOST_SECONDS is named, one
still counting is not, one that never counted reads 0 at once (a `multi_get` of a missing key waits for it); and a
look costs the launch's one store two calls whatever the world size, where one call per peer (511 per look of each
of 512 stalled ranks, every LIVENESS_SECONDS) could slow every rank's heartbeats (bench/frozen_look.py)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from models import collective
from models.collective.store_client import _alive_key, signs_of_life


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test-signs-of-life")
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def _counting(store) -> tuple:
    """`call(op)` on `store`, one store call each, and the list counting them."""
    calls: list[int] = []

    def call(op):
        calls.append(1)
        return op(store)

    return call, calls


def test_a_silent_peer_is_frozen_and_a_slow_one_still_counting_is_not(monkeypatch, store) -> None:
    now = [1000.0]
    monkeypatch.setattr(collective.frozen.time, "monotonic", lambda: now[0])
    call, _ = _counting(store)
    for r in (0, 1, 2):
        store.add(_alive_key(r), 3)
    seen: dict = {}
    assert collective.frozen.frozen_peers(call, 3, 0, seen) == []
    now[0] += collective.timing.LOST_SECONDS / 2
    store.add(_alive_key(2), 1)  # rank 2 slow (a long step of its own) but alive
    assert collective.frozen.frozen_peers(call, 3, 0, seen) == []
    now[0] += collective.timing.LOST_SECONDS / 2 + 1
    store.add(_alive_key(2), 1)
    assert collective.frozen.frozen_peers(call, 3, 0, seen) == [1]


def test_a_rank_that_never_counted_reads_zero_without_a_wait(store) -> None:
    call, _ = _counting(store)
    store.add(_alive_key(0), 4)
    began = time.monotonic()
    assert signs_of_life(call, [0, 1]) == [4, 0]
    assert time.monotonic() - began < 4, "a missing counter was waited for (the store's timeout)"
    store.add(_alive_key(1), 2)
    assert signs_of_life(call, [0, 1]) == [4, 2]


def test_a_look_at_512_ranks_costs_the_store_two_calls(monkeypatch, store) -> None:
    world = 512
    monkeypatch.setenv("RANK", "0")
    for r in range(world):
        store.add(_alive_key(r), 1)
    call, calls = _counting(store)
    assert collective.frozen.frozen_peers(call, world, 0, {}) == []
    assert len(calls) == 2, f"the frozen-peer look made {len(calls)} store calls"
    calls.clear()
    assert collective.arrive._lost_ranks(call, "arrived/x/1", world, {}) == []
    assert len(calls) == 2, f"the arrival's look made {len(calls)} store calls"
    calls.clear()
    assert collective.publish._watching_ranks(call, world) == list(range(1, world))
    assert len(calls) == 2, f"the publisher's look made {len(calls)} store calls"
