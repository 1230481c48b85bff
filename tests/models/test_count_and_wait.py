"""The wait of a rank about to end until every rank has counted itself (`collective.counting._count_and_wait`) asks the
launch's store a bounded number of keys: every rank of a failed launch waits so (`_known_by_all`), all polling one
TCPStore, served by one thread."""

from __future__ import annotations

from models import collective

WORLD = 512


class _Store:
    """A store where one more rank counts itself each time the waiting rank sleeps; it records the keys asked."""

    def __init__(self, counter: str) -> None:
        self.counter, self.keys, self.asked, self.arrived = counter, set(), 0, 1

    def set(self, key: str, value: str) -> None:
        self.keys.add(key)

    def check(self, keys: list[str]) -> bool:
        self.asked += len(keys)
        return all(k in self.keys for k in keys)

    def arrive(self, _seconds: float) -> None:
        self.keys.add(f"{self.counter}/{self.arrived}")
        self.arrived += 1


def test_the_wait_for_every_rank_asks_each_key_about_once(monkeypatch) -> None:
    counter = "test/count-and-wait/known"
    store = _Store(counter)
    monkeypatch.setenv("RANK", "0")
    # the loop ends when every rank is counted, not by time
    monkeypatch.setattr(collective.timing, "HOST_WAIT_SECONDS", 1e9)
    monkeypatch.setattr(collective.counting.time, "sleep", store.arrive)
    collective.counting._count_and_wait(store, counter, WORLD)
    assert store.arrived == WORLD  # it waited for the last rank, and no longer
    # one poll per rank arriving (511 here): asked all 512 keys each time, 262k keys through the store's one thread
    # per waiting rank, and every rank waits (at 512 ranks 10 polls/s of 34 kB each, ~0.2 ms of the store's time:
    # the store saturated). Ranks known counted are not asked again: about a key per poll
    assert store.asked <= 3 * WORLD, store.asked
