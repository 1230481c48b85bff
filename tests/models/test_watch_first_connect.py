"""A watch thread whose first connect to the launch's store failed within its bound (models/collective/
`watch_failures`: CONNECT_SECONDS, two reverse DNS lookups of torch's connect left unanswered). Before, the rank
gave up silently and ran with no watch thread: it counted no sign of life, so the ranks waiting for it
(`arrive_together`) named this live rank as lost and stopped a healthy launch, and a failure another rank published
never stopped it. Now the thread connects again (`_reconnect`, STORE_RETRY_SECONDS), and a store that never
answers is said in one line. The slow connect is injected (`_store_client` raising as its bound running out), not
left to DNS. This process plays rank 1 of 2 against a real TCPStore the test serves."""

from __future__ import annotations

from own_collective import own_collective, patch_where_used  # noqa: F401  (the fixture)
from test_failure_lines import _as_rank_1
from test_store_hiccup import _wait_for


def _first_connects_time_out(monkeypatch, collective, failing: float) -> dict:
    """`_store_client` raising as when torch's connect took its whole bound, for its first `failing` calls."""
    real, calls = collective.store_client._store_client, {"failed": 0}

    def slow_then_real(timeout=10.0):
        if calls["failed"] < failing:
            calls["failed"] += 1
            raise TimeoutError(f"no store answered within {timeout:.0f} s, the last try: DistStoreError: timeout")
        return real(timeout)

    patch_where_used(monkeypatch, "_store_client", slow_then_real)  # the watch's first connect, its reconnects
    return calls


def test_a_rank_whose_first_store_connect_timed_out_still_counts_alive_and_watches(monkeypatch, own_collective):
    collective = own_collective
    store = _as_rank_1(monkeypatch)
    calls = _first_connects_time_out(monkeypatch, collective, failing=1)
    exits: list[int] = []
    monkeypatch.setattr(collective.watch.os, "_exit", exits.append)
    collective.watch_failures(2)
    assert calls["failed"] == 1
    # signs of life: rank 0, waiting for this rank in `arrive_together`, sees it alive (before: none, ever)
    alive = collective.store_client._alive_key(1)
    _wait_for(lambda: store.add(alive, 0) >= 2, "no sign of life after a timed-out first connect")
    # and it watches: a failure rank 0 publishes ends this process with its line
    store.compare_set(collective.store_client._failure_key(), "", "rank 0 ran out of memory in the forward")
    store.set(f"{collective.store_client._failure_key()}/known/0", "1")
    _wait_for(lambda: exits == [1], "a published failure went unseen after a timed-out first connect")


def test_a_rank_that_never_reaches_the_store_says_so_in_one_line(monkeypatch, own_collective, capsys) -> None:
    collective = own_collective
    _store = _as_rank_1(monkeypatch)  # held: its port answers the probe, the client never connects
    _first_connects_time_out(monkeypatch, collective, failing=float("inf"))
    monkeypatch.setattr(collective.timing, "STORE_RETRY_SECONDS", 0.0)  # the retries' bound, run out at once
    collective.watch_failures(2)
    stop, watcher = collective.state.run["watcher"]
    _wait_for(lambda: not watcher.is_alive(), "the watch thread went on without a store")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: rank 1 could not reach the launch's store at 127.0.0.1:")
    assert "does not watch the other ranks" in lines[0]
    collective.state.run["stop_watching"]()  # the exit counts nothing in a store it never reached
    assert not _store.check([f"{collective.store_client._launch_key('exited')}/1"])
