"""`_lost_ranks`, the arrival's liveness rule (models/collective/arrive.py `arrive_together`), on a fake store:
a rank not arrived whose watch thread's counter stopped for LOST_SECONDS is lost; one still counting and one arrived
are not; one that never counted (still starting) only after BEFORE_GROUP_SECONDS. The waits themselves, on two
processes: tests/stages/test_uneven_ranks.py (and ranks naming their own model paths in the step:
tests/stages/test_fingerprint_ranks.py)."""

from __future__ import annotations

import pytest
from own_collective import own_collective  # noqa: F401  (the fixture)

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

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def append(self, key: str, value: str) -> None:
        self.values[key] = self.values.get(key, "") + value

    def get(self, key: str) -> bytes:
        return str(self.values[key]).encode()

    def arrive(self, key: str, ranks) -> None:
        """`ranks` arrived at `key`, as `arrive_together` marks them."""
        for r in ranks:
            self.values[f"{key}/{r}"] = 1
            self.append(f"{key}/ranks", f"{r},")
            self.add(key, 1)

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


def test_a_long_wait_says_who_it_waits_for() -> None:
    """A rank alive but stuck keeps its signs of life: the others wait on without an end (no collective timeout
    any more), so the wait says who it waits for."""
    store, key = FakeStore(), "arrived/x/1"
    store.arrive(key, (2, 1))  # ranks 1 and 2 arrived; 0 and 3 still working
    line = collective.arrive._wait_notice(store.call, key, 4, 1260.0, "checkpoint write")
    assert line == ("checkpoint write: 2 of 4 ranks have waited 21 min for rank(s) 0, 3, still alive (working, or "
                    "stuck: its node's logs say which)")


@pytest.mark.parametrize("missing", [1, 256])
def test_a_long_waits_notice_costs_one_store_call_whoever_is_missing(missing: int) -> None:
    """Asking each rank's own mark cost calls that grew with the low ranks missing (512 ranks: 1,531 calls with
    rank 0 missing, 66,046 with 256 missing); every arrival read at once is one call."""
    store, key, world, calls = FakeStore(), "arrived/x/1", 512, []
    store.arrive(key, range(missing, world))  # the lowest ranks still write their checkpoints

    def call(op):
        calls.append(1)
        return op(store)

    line = collective.arrive._wait_notice(call, key, world, 1260.0, "checkpoint write")
    assert line.startswith(f"checkpoint write: {world - missing} of {world} ranks have waited 21 min for rank(s) 0")
    assert len(calls) == 1, len(calls)


@pytest.mark.parametrize("arrived_before", [0, 1])
def test_only_the_first_rank_arrived_says_whom_the_wait_is_for(monkeypatch, capsys, own_collective,
                                                               arrived_before: int) -> None:
    """One line per notice for the whole launch, not one per waiting rank, and the others ask the store nothing
    for it (no `get`)."""
    collective, store, gets = own_collective, FakeStore(), []
    for name, value in {"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(collective.arrive, "watch_failures", lambda world: None)
    monkeypatch.setattr(collective.arrive, "_store_client", lambda timeout=10.0: store)
    monkeypatch.setattr(collective.arrive, "_lost_ranks", lambda *a: [])
    monkeypatch.setattr(collective.timing, "WAIT_NOTICE_SECONDS", 0.0)
    monkeypatch.setattr(collective.timing, "POLL_SECONDS", 0.0)
    key = f"{collective.store_client._launch_key('arrived')}/1"
    store.arrive(key, range(2, 2 + arrived_before))
    polls = iter([1 + arrived_before, 3])  # rank 0 still missing at the first poll, there at the next
    add, get = store.add, store.get
    monkeypatch.setattr(store, "add", lambda k, n: next(polls) if n == 0 and k == key else add(k, n))
    monkeypatch.setattr(store, "get", lambda k: gets.append(k) or get(k))
    collective.arrive_together(3, "checkpoint write")
    err = capsys.readouterr().err
    if arrived_before:
        assert gets == [] and "waited" not in err, err
    else:
        assert "ranks have waited 0 min for rank(s) 0, 2" in err and len(gets) == 1, err
