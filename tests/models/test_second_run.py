"""A second launched run in the same process (a test's in-process `main()`, a notebook) watches its own peers: the
CLI's entry point starts each run with the collective's state afresh (models/collective/watch.py `new_run`), as it does
the signal record. Before, `watching` stayed set from the first run: the second started no watch thread, and a
peer failing in it was never seen (no line, no stop; the rank waited on at its next exchange). This process plays
rank 1 of 2 in two launches, each against a real TCPStore the test serves (tests/models/test_failure_lines.py)."""

from __future__ import annotations

import os
import signal
import time

from own_collective import own_collective  # noqa: F401  (the fixture)
from test_failure_lines import _as_rank_1
from test_launch_devices import TIMEOUT


def _main_running(monkeypatch, work, signalled: tuple[int, ...] = ()) -> None:
    """`pipeline.cli.main` running `work()` as its command, the handlers and signal record it installs restored;
    `signalled`: the signals an earlier run in the process left in the CLI's list."""
    import pipeline.cli as cli
    from schemas import interruptible

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(cli, "app", work)
    monkeypatch.setattr(cli, "_signalled", list(signalled))
    monkeypatch.setattr(interruptible, "_received", {"fd": None, "seen": set(), "write": None})
    monkeypatch.setattr(cli.exit_gc, "collect_once_at_exit", lambda: None)  # this worker's exit is not the run's
    try:
        cli.main()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(-1)
        for end in ("fd", "write"):
            if interruptible._received.get(end) is not None:
                os.close(interruptible._received[end])


def test_a_second_run_in_the_process_sees_its_failing_peer(monkeypatch, own_collective) -> None:
    collective = own_collective
    exits: list[int] = []
    monkeypatch.setattr(collective.watch.os, "_exit", exits.append)  # the watch thread ends the process after its line
    first = _as_rank_1(monkeypatch)  # the first launch's store, serving until the test ends
    _main_running(monkeypatch, lambda: collective.watch_failures(2))  # the first run: its first exchange
    first_watch = collective.state.run["watcher"][1]
    assert first_watch.is_alive()

    second = _as_rank_1(monkeypatch)  # the next launch: another store
    _main_running(monkeypatch, lambda: collective.watch_failures(2))
    assert not first_watch.is_alive(), "the first run's watch thread still polls its store"
    key = collective.store_client._failure_key()
    second.set(f"{key}/known/0", "1")  # rank 0 counts itself among the ranks that read it
    second.compare_set(key, "", "rank 0 failed: its line")  # rank 0 of the second run fails alone
    deadline = time.monotonic() + TIMEOUT
    while not exits:
        assert time.monotonic() < deadline, "the second run's failing peer was never seen"
        time.sleep(0.05)
    assert exits == [1] and not first.check([f"{key}/known/1"])  # read from the second run's store alone
    assert second.check([f"{key}/known/1"])  # this rank read the second run's line
