"""The one line each launched rank ends with when a rank fails (models/collective/: `failure_line`, `report_once`,
the watch thread; the CLI's handlers in pipeline/commands/common.py). This process plays rank 1 of 2 against a
real TCPStore on 127.0.0.1 that the test serves, as torchrun's agent does (`own_collective`: the collective's
state is this test's alone, its watch thread stopped at the end)."""

from __future__ import annotations

import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from own_collective import own_collective  # noqa: F401  (the fixture)
from test_launch_devices import _TWO_DECISIONS, TIMEOUT, _env
from warm_start import WarmProcess, outcomes


def _as_rank_1(monkeypatch) -> dist.TCPStore:
    """The launch's store, and this process's environment as rank 1 of a torchrun launch of 2 (one key per test:
    no run id)."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    for name, value in _env(1, store.port, agent_store=True).items():
        monkeypatch.setenv(name, value)
    return store


def test_a_failure_every_rank_met_is_printed_once_on_each(monkeypatch, own_collective, capsys) -> None:
    """Rank 0 published the failure this rank meets too (not agreed: each meets it alone). This rank's watch
    thread reads the line while its main thread, in the CLI's handler, publishes and prints the same one. Before:
    the handler printed without `report_once`, and the watch thread printed it again before ending the process:
    the user saw the line twice."""
    import typer

    from pipeline.commands.common import user_errors
    from schemas.errors import UserError

    collective = own_collective
    store = _as_rank_1(monkeypatch)
    exits: list[int] = []
    monkeypatch.setattr(collective.watch.os, "_exit", exits.append)  # the watch thread ends the process after its line
    line = "1 of 6 samples of the images table are damaged: run `pipeline store repair`"
    key = collective.store_client._failure_key()
    collective.watch_failures(2)
    store.compare_set(key, "", line)  # rank 0 met it first
    store.set(f"{key}/known/0", "1")  # and counts itself among the ranks that read it
    deadline = time.monotonic() + TIMEOUT
    while not store.check([f"{key}/known/1"]):  # the watch thread read it: past its "did this rank publish?" check
        assert time.monotonic() < deadline, "the watch thread never read the published line"
        time.sleep(0.05)
    with pytest.raises(typer.Exit):
        with user_errors():
            raise UserError(line)
    for watcher in [t for t in threading.enumerate() if t.name == "rank-failure-watch"]:  # unless it ended
        watcher.join(TIMEOUT)
    err = capsys.readouterr().err
    assert [s for s in err.splitlines() if s.strip()] == [f"error: {line}"], err


def test_an_error_no_handler_made_a_line_of_is_published_naming_its_rank(monkeypatch, own_collective) -> None:
    """The CLI's handler of any error (`user_errors`) re-raises one it has no line for (its traceback is this
    rank's) after publishing it: the other ranks print which rank failed. Before: `RuntimeError: ...`, no rank."""
    from pipeline.commands.common import user_errors

    collective = own_collective
    store = _as_rank_1(monkeypatch)
    key = collective.store_client._failure_key()
    collective.watch_failures(2)
    store.set(f"{key}/known/0", "1")  # rank 0 reads it
    with pytest.raises(RuntimeError):
        with user_errors():
            raise RuntimeError("damaged install\n(second line)")
    assert store.get(key).decode() == ("rank 1 failed: RuntimeError: damaged install (second line) (its traceback "
                                       "is in that rank's output)")


@pytest.mark.parametrize("watching", [True, False])
def test_an_error_both_top_level_handlers_meet_is_published_once(monkeypatch, own_collective, watching) -> None:
    """`user_errors` publishes the error it has no line for and re-raises it; the CLI's `main` (`_publish_uncaught`)
    then meets the same error. Before: it published again - a second store connection and a second wait for the
    ranks to read it (up to HOST_WAIT_SECONDS for a rank that never counts), or, before the first exchange, a
    second try to reach the store (UNWATCHED_STORE_SECONDS)."""
    from pipeline.cli import _publish_uncaught
    from pipeline.commands.common import user_errors

    collective = own_collective
    store = _as_rank_1(monkeypatch)
    key = collective.store_client._failure_key()
    if watching:
        collective.watch_failures(2)
    store.set(f"{key}/known/0", "1")  # rank 0 reads it
    writes: list[str] = []
    write = collective.publish._write_failure
    monkeypatch.setattr(collective.publish, "_write_failure", lambda line, *a: writes.append(line) or write(line, *a))
    with pytest.raises(RuntimeError):
        try:
            with user_errors():
                raise RuntimeError("a bug")
        except RuntimeError as e:
            assert _publish_uncaught(e) is None  # this rank's own error: its traceback follows
            raise
    assert writes == ["rank 1 failed: RuntimeError: a bug (its traceback is in that rank's output)"]
    assert store.get(key).decode() == writes[0]


_GLOO_CLOSED = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234"


@pytest.mark.parametrize("published", [True, False])
def test_the_cli_top_level_names_the_peer_a_collective_error_came_from(monkeypatch, own_collective,
                                                                       published) -> None:
    """An error outside `user_errors` that is another rank's failure seen here: the line that rank published, or,
    when a rank was killed without a word, the lost-peer line (published) - as `user_errors` chooses. Before: the
    CLI's top level published `rank 1 failed: RuntimeError: ... Connection closed ...`, naming this rank, and
    ended in gloo's traceback."""
    from pipeline.cli import _publish_uncaught

    collective = own_collective
    store = _as_rank_1(monkeypatch)
    key = collective.store_client._failure_key()
    collective.watch_failures(2)
    store.set(f"{key}/known/0", "1")  # rank 0 reads it (or the launcher counted for it)
    peer = "rank 0: 1 of 6 samples of the images table are damaged"
    if published:
        collective.state.run["published"] = True  # this rank's watch thread leaves the line to the main thread
        store.compare_set(key, "", peer)
    line = _publish_uncaught(RuntimeError(_GLOO_CLOSED))
    expected = peer if published else collective.lost_peer_line(RuntimeError(_GLOO_CLOSED))
    assert line == expected and store.get(key).decode() == expected


def test_a_rank_failing_before_its_first_exchange_stops_the_rank_waiting_for_it(monkeypatch, own_collective) -> None:
    """Rank 1 (this process) fails before it ever exchanged through the store (no watch thread yet); rank 0 waits
    for it at the first decision and ends at once with its line. Before: only a watching rank published, and rank
    0 waited out the before-group bound (models/collective/timing.py BEFORE_GROUP_SECONDS, 30 minutes: here the test's
    bound fails it)."""
    collective = own_collective
    store = _as_rank_1(monkeypatch)
    rank0 = WarmProcess([sys.executable, "-c", _TWO_DECISIONS], env=_env(0, store.port, agent_store=True))
    error = RuntimeError("cannot import its model code (test)")
    line = collective.failure_line(error, collective.rank_error_line(error))
    assert line == ("rank 1 failed: RuntimeError: cannot import its model code (test) (its traceback is in that "
                    "rank's output)")
    [(code, out, err)] = outcomes([rank0], TIMEOUT)
    assert (code, out, err.strip()) == (1, "", f"error: {line}"), err[-3000:]


def test_a_file_where_a_rank_wants_a_folder_stops_the_rank_waiting_for_it(monkeypatch, own_collective) -> None:
    """Rank 1 (this process) meets a file where its node's copy of a path should be a folder (FileExistsError,
    NotADirectoryError: the CLI's "is a file, not a folder" line) while rank 0 waits for it at a decision; rank 0
    ends at once with that line. Before: that handler printed the line without publishing it, and rank 0 waited out
    the before-group bound (BEFORE_GROUP_SECONDS, 30 minutes; in a collective: its timeout; here the test's bound
    fails it)."""
    import typer

    from pipeline.commands.common import user_errors

    collective = own_collective
    store = _as_rank_1(monkeypatch)
    rank0 = WarmProcess([sys.executable, "-c", _TWO_DECISIONS], env=_env(0, store.port, agent_store=True))
    collective.gather_before_group(2, "the config", "")
    with pytest.raises(typer.Exit):
        with user_errors():
            raise FileExistsError(17, "File exists", "/data/run/out")
    [(code, out, err)] = outcomes([rank0], TIMEOUT)
    line = "/data/run/out (or a folder on its path) is a file, not a folder: pass a folder path"
    assert (code, out, err.strip()) == (1, "first decided\n", f"error: {line}"), err[-3000:]


def test_a_usage_refusal_of_one_rank_stops_the_rank_waiting_for_it(monkeypatch, own_collective) -> None:
    """Rank 1 (this process) refuses a flag by its node's files (`usage_errors`: predict's --out an existing
    folder there) while rank 0 waits for it at a decision; rank 0 ends at once with that line. Before: the refusal
    was printed without publishing it, and rank 0 waited out the before-group bound (BEFORE_GROUP_SECONDS, 30
    minutes; here the test's bound fails it)."""
    import typer

    from pipeline.commands.common import usage_errors
    from schemas.errors import UserError

    collective = own_collective
    store = _as_rank_1(monkeypatch)
    rank0 = WarmProcess([sys.executable, "-c", _TWO_DECISIONS], env=_env(0, store.port, agent_store=True))
    collective.gather_before_group(2, "the config", "")
    line = "--out /data/edited is a folder; pass the image file to write, e.g. /data/edited/edited.png"
    with pytest.raises(typer.Exit) as ended:
        with usage_errors():
            raise UserError(line)
    assert ended.value.exit_code == 2  # still a usage mistake on the rank that made it
    [(code, out, err)] = outcomes([rank0], TIMEOUT)
    assert (code, out, err.strip()) == (1, "first decided\n", f"error: {line}"), err[-3000:]


def test_a_single_process_publishes_nothing(monkeypatch, own_collective) -> None:
    """No launch of several ranks: the line as it is, no store tried (a run without a launcher never waits)."""
    collective = own_collective
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "9")  # nothing serves there: a try would fail only after its timeout
    assert collective.failure_line(RuntimeError("x"), "x") == "x" and not collective.state.run["published"]


def test_a_rank_that_drew_no_progress_bar_prints_no_blank_line(monkeypatch, own_collective, capsys) -> None:
    """tqdm is imported on every rank (the libraries import it); a rank whose main thread shows no bar (it waits
    for the others) printed a blank line before its error all the same."""
    import weakref

    from tqdm import tqdm

    monkeypatch.setattr(tqdm, "_instances", weakref.WeakSet())  # bars other tests left open are not this rank's
    assert own_collective.report_once("rank 1 failed: RuntimeError: x")
    assert capsys.readouterr().err == "error: rank 1 failed: RuntimeError: x\n"


class _HeldStream:
    """A bar's stream that holds the write of nothing tqdm's `close` makes (its check that the stream is open)
    once `hold` is set, until `release` is: a bar closing in another thread, dropped from tqdm's open bars, its
    last state and newline not yet written. Writes go to this moment's stderr (the test's capture)."""

    def __init__(self) -> None:
        self.hold, self.held, self.release = threading.Event(), threading.Event(), threading.Event()

    def write(self, text: str) -> int:
        if not text and self.hold.is_set():
            self.held.set()
            self.release.wait(TIMEOUT)
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@pytest.mark.parametrize("closing", [False, True])
def test_a_peers_failure_line_starts_a_line_of_its_own_after_a_bar(monkeypatch, own_collective, capsys,
                                                                   closing) -> None:
    """The watch thread prints a peer's failure while this rank's main thread shows a progress bar (it is stuck
    in its loop), or is closing one: tqdm drops the bar from its open ones before it writes its last state, and
    the line was glued to the bar's text (the clean CI run's failure in test_rank_fails_alone: rank 0's last line
    began with its bar)."""
    import weakref

    from tqdm import tqdm

    monkeypatch.setattr(tqdm, "_instances", weakref.WeakSet())
    stream = _HeldStream()
    bar = tqdm(total=3, desc="encode-vae r0", file=stream, leave=True)
    bar.update(2)
    bar.refresh()
    closer = threading.Thread(target=bar.close, name="closing-bar")
    try:
        if closing:
            stream.hold.set()
            closer.start()
            assert stream.held.wait(TIMEOUT), "the bar never began to close"
        assert own_collective.report_once("1 of 6 samples are damaged")
        err = capsys.readouterr().err
    finally:
        stream.release.set()
        if closing:
            closer.join(TIMEOUT)
        bar.close()
    assert "encode-vae r0" in err and err.endswith("\nerror: 1 of 6 samples are damaged\n"), err
    assert err.splitlines()[-1] == "error: 1 of 6 samples are damaged", err


def test_out_of_memory_in_one_process_is_one_line_with_advice_and_other_errors_pass_through() -> None:
    """One GPU, one process: a CUDA out-of-memory error in the step was a traceback that said nothing of what to
    change (the advice was given only where several ranks ran); now the same line as a rank's, as a UserError."""
    import pytest
    import torch

    from models.collective import fails_alone
    from schemas.errors import UserError

    with pytest.raises(UserError) as caught:
        with fails_alone(1, "optimizer step 3", "lower train.batch_size"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    assert str(caught.value) == ("ran out of memory in optimizer step 3 (CUDA out of memory. Tried to allocate "
                                 "2.00 GiB): lower train.batch_size")
    with pytest.raises(ValueError, match="not memory"):
        with fails_alone(1, "optimizer step 3", "lower train.batch_size"):
            raise ValueError("not memory")
