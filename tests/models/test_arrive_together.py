"""`_lost_ranks`, the arrival's liveness rule (models/collective/arrive.py `arrive_together`), on a fake store:
a rank not arrived whose watch thread's counter stopped for LOST_SECONDS is lost; one still counting and one arrived
are not; one that never counted (still starting) only after BEFORE_GROUP_SECONDS. The waits themselves, on two
processes: tests/stages/test_uneven_ranks.py (and ranks naming their own model paths in the step:
tests/stages/test_fingerprint_ranks.py)."""

from __future__ import annotations

from models import collective


class FakeStore:
    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def add(self, key: str, n: int) -> int:
        self.values[key] = self.values.get(key, 0) + n
        return self.values[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [str(self.values[k]).encode() for k in keys]  # a missing key: KeyError (torch's waits for it)

    def call(self, op):
        """One call through this client, as `collective.reconnect._read` makes each of a batch's calls."""
        return op(self)


def test_a_rank_whose_signs_of_life_stopped_is_lost_and_only_it(monkeypatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(collective.arrive.time, "monotonic", lambda: now[0])
    store, key, seen = FakeStore(), "arrived/x/1", {}
    store.values[f"{key}/0"] = 1  # rank 0 arrived
    for r in (1, 2):  # ranks 1 and 2 alive so far; rank 3 never counted
        store.add(collective.store_client._alive_key(r), 5)
    assert collective.arrive._lost_ranks(store.call, key, 4, seen) == []
    now[0] += collective.timing.LOST_SECONDS / 2
    store.add(collective.store_client._alive_key(2), 1)  # rank 2 still works
    assert collective.arrive._lost_ranks(store.call, key, 4, seen) == []
    now[0] += collective.timing.LOST_SECONDS / 2 + 1  # rank 1 silent for longer than LOST_SECONDS, rank 2 not
    store.add(collective.store_client._alive_key(2), 1)
    assert collective.arrive._lost_ranks(store.call, key, 4, seen) == [1]
    store.values[f"{key}/1"] = 1  # arrived after all: never lost
    now[0] += 10 * collective.timing.LOST_SECONDS
    lost_ranks = collective.arrive._lost_ranks
    assert lost_ranks(store.call, key, 4, seen) == [2]  # now silent too; rank 3 (no count ever) not yet
    now[0] += collective.timing.BEFORE_GROUP_SECONDS
    assert collective.arrive._lost_ranks(store.call, key, 4, seen) == [2, 3]


def test_a_long_wait_says_who_it_waits_for_once_by_the_lowest_rank_arrived() -> None:
    """A rank alive but stuck keeps its signs of life: the others wait on without an end (no collective timeout
    any more), so the wait says who it waits for, on one rank only (not 64 lines)."""
    store, key = FakeStore(), "arrived/x/1"
    for r in (1, 2):
        store.values[f"{key}/{r}"] = 1  # ranks 1 and 2 arrived; 0 and 3 still working
    line = collective.arrive._wait_notice(store.call, key, 4, 1, 1260.0, "checkpoint write")
    assert line == ("checkpoint write: 2 of 4 ranks have waited 21 min for rank(s) 0, 3, still alive (working, or "
                    "stuck: its node's logs say which)")
    assert collective.arrive._wait_notice(store.call, key, 4, 2, 1260.0, "checkpoint write") is None


def test_a_long_waits_notice_asks_the_store_only_up_to_the_lowest_arrived() -> None:
    """Every waiting rank asks at the same time: each one asking for every rank's arrival would be 262,144 calls on
    the one store at 512 ranks; a rank above the lowest arrived stops at it."""
    store, key, world, calls = FakeStore(), "arrived/x/1", 512, []
    for r in range(1, world):
        store.values[f"{key}/{r}"] = 1  # rank 0 still writes its checkpoint

    def call(op):
        calls.append(1)
        return op(store)

    assert collective.arrive._wait_notice(call, key, world, 300, 1260.0, "checkpoint write") is None
    assert len(calls) == 2, len(calls)
