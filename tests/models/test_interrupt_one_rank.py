"""A Ctrl-C that reached one rank alone (its own terminal, one node's) in the middle of a step (models/collective/
`fails_alone`, `together`). Before, only an `Exception` was published: the KeyboardInterrupt ended this rank while
the others waited for it inside a collective (NCCL without torchrun: its 10-minute timeout; gloo: a lost peer,
named as killed). Now it is published first, so every other rank's watch thread ends its process with the line at
once, and it still propagates here (the rank stops as a Ctrl-C stops it). This process plays rank 1 of 2 against a
real TCPStore the test serves; tests/stages/test_rank_fails_alone.py runs the two ranks of a training."""

from __future__ import annotations

import pytest

from own_collective import own_collective, patch_where_used  # noqa: F401  (the fixture)
from test_failure_lines import _as_rank_1


def _rank_1_publishing(monkeypatch, collective) -> tuple:
    """This process as rank 1 of 2 (`_as_rank_1`): the store, the launch's failure key (rank 0 counted as having
    read the line: its watch thread does so, not waited for here) and the lines this rank publishes, in order."""
    store = _as_rank_1(monkeypatch)
    key = collective.store_client._failure_key()
    store.set(f"{key}/known/0", "1")
    writes: list[str] = []
    real = collective.publish_failure
    monkeypatch.setattr(collective.interrupt, "publish_failure",  # a Ctrl-C's (`_tell_interrupt`)
                        lambda line, world: writes.append(line) or real(line, world))
    return store, key, writes


@pytest.mark.parametrize("block", ["fails_alone", "together"])
def test_a_ctrl_c_on_one_rank_is_published_and_still_raised(monkeypatch, own_collective, block) -> None:
    collective = own_collective
    store, key, _ = _rank_1_publishing(monkeypatch, collective)
    with pytest.raises(KeyboardInterrupt):
        with getattr(collective, block)(2, "the training step"):
            raise KeyboardInterrupt
    line = store.get(key).decode()
    assert line.startswith("rank 1 was stopped by SIGINT (Ctrl-C) in the training step: what the ranks committed is "
                           "kept"), line
    assert "with --resume" in line


def test_a_ctrl_c_in_nested_blocks_is_published_once(monkeypatch, own_collective) -> None:
    collective = own_collective
    store, key, writes = _rank_1_publishing(monkeypatch, collective)
    with pytest.raises(KeyboardInterrupt):
        with collective.together(2, "the step"), collective.fails_alone(2, "the forward"):
            raise KeyboardInterrupt
    assert len(writes) == 1 and "in the forward" in store.get(key).decode()


def test_a_ctrl_c_told_in_a_block_is_not_told_again_at_the_top_level(monkeypatch, own_collective) -> None:
    """The CLI's top level publishes a Ctrl-C that stopped the rank outside the blocks (pipeline/cli.py,
    tests/stages/test_rank_interrupt_waited.py); one that `fails_alone` told already is not told twice (a second
    store connection and wait at the exit). One outside the blocks is told there, naming no step."""
    collective = own_collective
    store, key, writes = _rank_1_publishing(monkeypatch, collective)
    with pytest.raises(KeyboardInterrupt) as stopped:
        with collective.fails_alone(2, "the forward"):
            raise KeyboardInterrupt
    collective.publish_interrupt(stopped.value)
    assert len(writes) == 1 and "in the forward" in store.get(key).decode()
    store.delete_key(key)
    collective.publish_interrupt(KeyboardInterrupt())  # outside any block: told here
    assert len(writes) == 2 and store.get(key).decode().startswith("rank 1 was stopped by SIGINT (Ctrl-C): what")


def test_a_ctrl_c_before_the_ranks_first_exchange_is_published_where_the_store_answers(monkeypatch,
                                                                                      own_collective) -> None:
    """A Ctrl-C that stops a launched rank before its own first exchange (it watches nothing yet: loading its
    config, importing torch), through the CLI's top level (pipeline/cli.py `_publish_interrupt`): published where
    the launch's store answers (torchrun's agent serves it from the start), so the ranks already waiting for this
    one at their first exchange stop with its line. Before: nothing was published, and they waited
    BEFORE_GROUP_SECONDS (30 minutes)."""
    import signal

    from pipeline import cli

    collective = own_collective
    store, key, _ = _rank_1_publishing(monkeypatch, collective)
    monkeypatch.setattr(cli, "_signalled", [signal.SIGINT])
    assert not collective.state.run["watching"]
    cli._publish_interrupt(KeyboardInterrupt())
    assert store.check([key]), "nothing published"
    assert store.get(key).decode().startswith("rank 1 was stopped by SIGINT (Ctrl-C): what the ranks committed")


@pytest.mark.parametrize("rank_0", ["starting", "watching"])
def test_a_ctrl_c_before_the_first_exchange_waits_only_for_the_ranks_watching(monkeypatch, own_collective,
                                                                              rank_0) -> None:
    """That exit's publish waits only for the ranks that watch already (a sign of life in the store): those that
    may wait for this one and read its line at once. Before, it waited HOST_WAIT_SECONDS for every rank to read it,
    also where none had reached its first exchange (nobody waiting for this one): 14 s with torch's import, a
    second Ctrl-C needed. Here a wait for rank 0 would last an hour (the bound below is not a timing assert)."""
    import signal
    import threading

    from pipeline import cli
    from test_launch_devices import TIMEOUT

    collective = own_collective
    store = _as_rank_1(monkeypatch)  # rank 0 counts nothing as read: it is not watching, or not yet
    key = collective.store_client._failure_key()
    monkeypatch.setattr(collective.timing, "HOST_WAIT_SECONDS", 3600.0)
    monkeypatch.setattr(cli, "_signalled", [signal.SIGINT])
    if rank_0 == "watching":
        store.add(collective.store_client._alive_key(0), 1)  # its watch thread's sign of life
    exiting = threading.Thread(target=cli._publish_interrupt, args=(KeyboardInterrupt(),), daemon=True)
    exiting.start()
    if rank_0 == "watching":  # it reads the line: waited for until then
        while not store.check([key]):
            exiting.join(0.05)
        assert exiting.is_alive(), "the exit did not wait for a rank that watches"
        store.set(f"{key}/known/0", "1")
    exiting.join(TIMEOUT)
    assert not exiting.is_alive(), "the exit waited for a rank that is not watching"
    assert store.get(key).decode().startswith("rank 1 was stopped by SIGINT (Ctrl-C): what the ranks committed")


def test_a_ctrl_c_before_the_first_exchange_on_one_torchrun_node_tells_no_one(monkeypatch, own_collective) -> None:
    """Every rank a worker of this node's torchrun agent: this rank's exit makes the agent stop them all (and the
    agent says the line), so the exit publishes nothing: no store connection, no import of torch where the Ctrl-C
    came before it. Before, each rank of a terminal's Ctrl-C (the agent waiting for their exits) imported torch and
    connected to publish a line no rank was waiting for."""
    import signal

    from pipeline import cli
    from test_launch_devices import _env

    collective = own_collective
    store = _as_rank_1(monkeypatch)
    for name, value in _env(1, store.port, agent_store=True, nodes=1).items():  # 2 ranks on this node
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "one-node")
    monkeypatch.setattr(cli, "_signalled", [signal.SIGINT])
    connected: list[float] = []
    patch_where_used(monkeypatch, "_store_client", lambda timeout=10.0: connected.append(timeout))
    cli._publish_interrupt(KeyboardInterrupt())
    assert connected == [] and not store.check([collective.store_client._failure_key()])


@pytest.fixture
def sigint_here(monkeypatch):
    """A SIGINT that reached this process as a terminal's Ctrl-C reaches every rank: recorded at C level
    (`schemas.interruptible.record_signals`, the CLI's entry point) before any Python handler acts on it; the
    handler here does nothing (the test's main thread goes on). Restored after: the record, the handler, the fd."""
    import os
    import signal

    from schemas import interruptible

    monkeypatch.setattr(interruptible, "_received", {"fd": None, "seen": set()})
    handler = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        interruptible.record_signals()
        os.kill(os.getpid(), signal.SIGINT)
        assert interruptible.received(signal.SIGINT)
        yield
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, handler)
        for end in ("fd", "write"):  # the pipe's two ends (record_signals')
            if interruptible._received.get(end) is not None:
                os.close(interruptible._received[end])


def test_a_rank_the_same_ctrl_c_reached_ends_on_its_own_stop_not_a_peers_line(monkeypatch, own_collective,
                                                                                sigint_here, capsys) -> None:
    """A Ctrl-C on every rank at once (a terminal's): rank 0 publishes its stop first; this rank's watch thread
    reads that line before its main thread has acted on its own SIGINT (inside a collective's C++ call, or just
    later). Before: it printed rank 0's line and ended the process with status 1. Now it counts itself as having
    read the line and leaves the stop to its main thread (130, its own line); its exit stops the watch. The CLI's
    handler of any error (`user_errors`) does the same with a library's error made of the Ctrl-C: re-raised for
    the CLI's main to name the stop, not ended on the peer's line with 1."""
    import time

    import typer

    from pipeline.commands.common import user_errors
    from test_launch_devices import TIMEOUT

    collective = own_collective
    store, key, _ = _rank_1_publishing(monkeypatch, collective)
    exits: list[int] = []
    monkeypatch.setattr(collective.watch.os, "_exit", exits.append)
    peer = collective.interrupt._interrupt_line(0, "")
    store.compare_set(key, "", peer)  # rank 0 was first
    collective.watch_failures(2)
    deadline = time.monotonic() + TIMEOUT
    while not store.check([f"{key}/known/1"]):  # the watch thread read it
        assert time.monotonic() < deadline, "the watch thread never read the published line"
        time.sleep(0.05)
    with pytest.raises(RuntimeError):  # not typer.Exit(1) after the peer's line
        try:
            with user_errors():
                raise RuntimeError("Connection closed by peer (a library's call, stopped by the Ctrl-C)")
        except typer.Exit as e:
            pytest.fail(f"user_errors ended on exit {e.exit_code}")
    collective.state.run["stop_watching"]()  # this rank's exit
    assert exits == [] and "error:" not in capsys.readouterr().err
