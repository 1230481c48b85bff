"""A launch's store that fails a call now and then (a TCPStore busy past the client's timeout, a dropped connection)
while the store itself lives on: the watch thread (models/collective/watch.py `_watch`), the long waits
(`arrive_together`, `main_alone`) and a failure's publishing connect again (`_reconnect`) and go on. Before, one
failed call ended the watch thread for good, and with it this live rank's signs of life: the ranks waiting for it
stopped the launch after LOST_SECONDS, naming it as killed; a failed read of the wait itself (`arrive_together`,
`main_alone`) ended the rank in a traceback. A store that is gone (its host ended) still ends the watch at once,
without torch's C++ warnings of a client trying it again. This process plays rank 1 of 2 against a real TCPStore the
test serves (tests/models/test_failure_lines.py `_as_rank_1`)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from own_collective import own_collective, patch_where_used  # noqa: F401  (the fixture)
from test_failure_lines import _as_rank_1
from launch_ports import start_host_first
from test_launch_devices import TIMEOUT, _env
from warm_start import WarmProcess, outcomes

REPO = Path(__file__).resolve().parents[2]


class FlakyClient:
    """The real client, except that its first `budget["left"]` calls that `budget["fails"]` matches raise as a
    store call that timed out does (the budget is shared by every connection made, as reconnecting is)."""

    def __init__(self, real, budget: dict) -> None:
        self.real, self.budget = real, budget

    def __getattr__(self, name: str):
        call = getattr(self.real, name)

        def flaky(*args):
            if self.budget["left"] and self.budget["fails"](name, *args):
                self.budget["left"] -= 1
                raise dist.DistStoreError("Socket Timeout")
            return call(*args)

        return flaky


def _flaky_clients(monkeypatch, collective, fails, left: int) -> dict:
    budget = {"fails": fails, "left": left}
    real = collective.store_client._store_client
    patch_where_used(monkeypatch, "_store_client", lambda timeout=10.0: FlakyClient(real(timeout), budget))
    return budget


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT  # a bound for a wait that never ends (the test then fails), not a timing
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_the_watch_thread_counts_this_rank_alive_on_after_failed_store_calls(monkeypatch, own_collective) -> None:
    collective = own_collective
    store = _as_rank_1(monkeypatch)
    alive = collective.store_client._alive_key(1)
    budget = _flaky_clients(monkeypatch, collective, lambda name, key, *_: name == "add" and key == alive, 3)
    exits: list[int] = []
    monkeypatch.setattr(collective.watch.os, "_exit", exits.append)
    collective.watch_failures(2)
    _wait_for(lambda: budget["left"] == 0, "the watch thread stopped calling the store")
    beats = store.add(alive, 0)
    # three signs of life after the third failure: a rank waiting in `arrive_together` sees this one alive (before:
    # none ever, the thread had ended at the first failure)
    _wait_for(lambda: store.add(alive, 0) >= beats + 3, "no sign of life after the store's failed calls")
    assert not collective.state.run.get("store_lost")  # its exit counts itself in the store again (`_count_exit`)
    # and it still watches: a failure another rank publishes ends this process with its line
    line = "rank 0 ran out of memory in the forward"
    store.compare_set(collective.store_client._failure_key(), "", line)
    store.set(f"{collective.store_client._failure_key()}/known/0", "1")
    _wait_for(lambda: exits == [1], "the watch thread missed a published failure after the store's failed calls")


def test_a_connection_made_again_waits_for_the_store_as_long_as_the_one_it_replaces(monkeypatch, own_collective):
    """After a failed call the new connection (`_reconnect`) kept PROBE_SECONDS (2 s) as its timeout for every later
    call: a store busy for 3 s, which the first connection (10 s) waited out, failed each call through it from then
    on - a reconnect per busy spell in the watch, and the waits of `_count_and_wait` (a failure's publishing, the
    exit) ending early, as if the store were gone."""
    collective = own_collective
    _store = _as_rank_1(monkeypatch)  # held: the server lives with its object
    for timeout in (10.0, collective.timing.UNWATCHED_STORE_SECONDS):
        clients = [collective.store_client._store_client(timeout)]
        assert collective.reconnect._reconnect(clients, threading.Event())
        assert clients[0].timeout == timedelta(seconds=timeout)


def test_an_uneven_wait_goes_on_after_a_failed_store_read(monkeypatch, own_collective) -> None:
    collective = own_collective
    store = _as_rank_1(monkeypatch)
    arrived = f"{collective.store_client._launch_key('arrived')}/1"
    budget = _flaky_clients(monkeypatch, collective, lambda name, key, *v: name == "add" and key == arrived
                            and v == (0,), 2)
    store.set(f"{arrived}/0", "1")  # rank 0 is there already
    store.add(arrived, 1)
    collective.arrive_together(2, "the encode's commit")  # before: DistStoreError out of the wait
    assert budget["left"] == 0 and store.add(arrived, 0) == 2


def test_a_rank_waiting_for_rank_0_alone_goes_on_after_a_failed_store_read(monkeypatch, own_collective) -> None:
    """`main_alone` (resize-bucket: hours of rank 0's work): the waiting rank's poll of rank 0's mark."""
    collective = own_collective
    store = _as_rank_1(monkeypatch)
    done = f"{collective.store_client._launch_key('done')}/resize-bucket"
    budget = _flaky_clients(monkeypatch, collective, lambda name, keys, *_: name == "check" and keys == [done], 2)
    store.set(done, "done")  # rank 0's work is over
    store.set(f"{done}/seen/0", "1")
    assert collective.main_alone(2, "resize-bucket", lambda: "rank 0's") is None  # before: DistStoreError
    assert budget["left"] == 0 and store.check([f"{done}/seen/1"])  # it saw the mark and said so


def _store_up_after_the_probe(monkeypatch, delay: float) -> tuple[list, threading.Thread]:
    """MASTER_PORT: a port that answers one probe, then refuses until a real store comes up there `delay` seconds
    later (torch's client connecting meanwhile waits that long)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    monkeypatch.setenv("MASTER_PORT", str(port))
    stores: list = []
    closed = threading.Event()
    probe = socket.create_connection

    def probe_then_closed(*args, **kwargs):
        # the probe's connection is made in the kernel's backlog before this thread's accept: torch's client,
        # right after it, could land there too and be reset by the close below (a c10d warning, once in a
        # loaded CI run); it connects only once the port refuses, as a store coming up later refuses
        conn = probe(*args, **kwargs)
        closed.wait(TIMEOUT)
        return conn

    monkeypatch.setattr(socket, "create_connection", probe_then_closed)

    def up_later() -> None:
        listener.accept()[0].close()
        listener.close()
        closed.set()
        time.sleep(delay)
        stores.append(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=60)))

    host = threading.Thread(target=up_later, daemon=True)
    host.start()
    return stores, host


def test_a_store_slow_to_take_a_new_connection_is_connected_to_quietly(monkeypatch, own_collective, capfd):
    """The port answers the probe, then torch's client takes 3 s to connect (here: the port refuses until the store
    comes up 3 s after the probe; once in a loaded CI run, a watch thread's first connect). Before: torch's client
    was tried for PROBE_SECONDS (2 s) after the probe, timed out and printed c10d's error and stack."""
    collective = own_collective
    _as_rank_1(monkeypatch)
    stores, host = _store_up_after_the_probe(monkeypatch, 3.0)
    client = collective.store_client._store_client(20.0)
    client.set("reached", "1")
    host.join(TIMEOUT)
    assert stores[0].get("reached") == b"1"
    err = capfd.readouterr().err
    assert "c10d" not in err and "frame #0" not in err, err


def test_a_rank_failing_before_its_first_exchange_outwaits_a_slow_connect(monkeypatch, own_collective):
    """A rank that fails before its first exchange publishes its line for the ranks waiting for it. Its connect
    took over 5 s once in a loaded CI run: it gave up at UNWATCHED_STORE_SECONDS (5 s), published nothing, and rank
    0 waited for it up to BEFORE_GROUP_SECONDS (30 minutes; the test's 120 s bound failed it). Here the store takes
    new connections 8 s after the probe."""
    collective = own_collective
    _as_rank_1(monkeypatch)
    stores, host = _store_up_after_the_probe(monkeypatch, 8.0)
    # before: TimeoutError after 5 s
    client = collective.store_client._store_client(collective.timing.UNWATCHED_STORE_SECONDS)
    client.set("published", "1")
    host.join(TIMEOUT)
    assert stores[0].get("published") == b"1"


def test_a_store_gone_ends_the_watch_at_once_and_quietly(monkeypatch, own_collective, capfd) -> None:
    """Its host ended: nothing listens on its port any more. The watch thread stops trying at the refused
    connection, long before STORE_RETRY_SECONDS (here: longer than the test waits), and neither it nor the exit
    (`_count_exit`) calls the store again: torch's client prints a C++ warning and stack at each call or try (after
    a rank's last line, where its exit came after the host's)."""
    collective = own_collective
    store = _as_rank_1(monkeypatch)
    monkeypatch.setattr(collective.timing, "STORE_RETRY_SECONDS", 10 * TIMEOUT)
    collective.watch_failures(2)
    alive = collective.store_client._alive_key(1)
    _wait_for(lambda: store.add(alive, 0) >= 1, "the watch thread never counted this rank alive")
    capfd.readouterr()  # what follows the store's end (a slow first connect is the test above's)
    del store  # the store's host ends (the server stops with its object: this test held the only one)
    watcher = next(t for t in threading.enumerate() if t.name == "rank-failure-watch")
    watcher.join(TIMEOUT)
    assert not watcher.is_alive(), "the watch thread kept trying a store that is gone"
    collective.state.run["stop_watching"]()  # the exit: nothing more through the store
    err = capfd.readouterr().err
    assert err.count("frame #0") <= 1 and "failed to connect" not in err, err  # the one failed poll's, at most


# Rank 1 fails alone (`fails_alone`) while rank 0 waits for it (`together(uneven=True)`: `arrive_together`); the
# store fails rank 1's first publishing call. LOST_SECONDS is short, so a failure never published ends the test soon
# (rank 0 then calls rank 1 lost), instead of after 120 s.
PUBLISH_SCRIPT = """
import sys
import torch.distributed as dist
from models import collective
from schemas.errors import UserError
dist.init_process_group("gloo")
collective.close_at_exit()
collective.timing.LOST_SECONDS = 5.0
if dist.get_rank() == 1:
    real, left = collective.store_client._store_client, [1]

    class Flaky:
        def __init__(self, client):
            self.client = client

        def __getattr__(self, name):
            if name == "compare_set" and left[0]:
                left[0] -= 1
                raise dist.DistStoreError("Socket Timeout")
            return getattr(self.client, name)

    collective.publish._store_client = lambda timeout=10.0: Flaky(real(timeout))  # the publish's (`_write_failure`)
try:
    if dist.get_rank() == 1:
        with collective.fails_alone(2, "its share"):
            raise UserError("rank 1's share of the images is damaged: run `pipeline store repair`")
    else:
        with collective.together(2, "the commit", uneven=True):
            pass
except UserError as e:
    collective.report_once(str(e))
    sys.exit(1)
"""


def test_a_failure_published_through_a_store_hiccup_still_stops_every_rank_with_its_line(tmp_path) -> None:
    """Before, the publishing call was made once: a hiccup there left the failure unpublished, and rank 0 waited
    until it called rank 1 lost (LOST_SECONDS: 120 s), ending on that line, not rank 1's."""
    script = tmp_path / "publish_through_hiccup.py"
    script.write_text(PUBLISH_SCRIPT)

    def start(rank: int, port: int) -> WarmProcess:
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO)}
        return WarmProcess([sys.executable, str(script)], env=env)

    (rc0, _, err0), (rc1, _, err1) = outcomes(start_host_first(start, 2), timeout=TIMEOUT)
    line = "error: rank 1's share of the images is damaged: run `pipeline store repair`"
    assert rc0 == rc1 == 1, (rc0, rc1, err0[-3000:], err1[-3000:])
    for err in (err0, err1):
        assert err.strip().splitlines()[-1] == line, err[-3000:]


# Rank 0 counts itself among the ranks that know a published line (`_known_by_all`) and waits for the others, its
# bound (HOST_WAIT_SECONDS) longer than the test waits: it returns only once rank 1 is counted.
COUNT_SCRIPT = """
from models import collective
collective.timing.HOST_WAIT_SECONDS = {wait}
collective.counting._count_and_wait(collective.store_client._store_client(), "{counter}", 2)
print("every rank counted", flush=True)
"""


def test_a_rank_counted_through_a_store_hiccup_is_counted_once(monkeypatch, own_collective) -> None:
    """A rank about to end counts itself in the store (`_count_and_wait`), and the store's host waits until every
    rank has. Before, the count was one `add`: a hiccup there left this rank uncounted and the host waiting its
    whole bound (HOST_WAIT_SECONDS; here longer than the test's bound, which fails it). An `add` tried again may
    count twice (a failed call may have been applied): each rank sets its own key instead."""
    collective = own_collective
    store = _as_rank_1(monkeypatch)
    counter = f"{collective.store_client._failure_key()}/known"
    budget = _flaky_clients(monkeypatch, collective, lambda name, key, *v: name in ("add", "set")
                            and key.startswith(counter) and v != (0,), 1)
    rank0 = WarmProcess([sys.executable, "-c", COUNT_SCRIPT.format(wait=10 * TIMEOUT, counter=counter)],
                        env=_env(0, store.port, agent_store=True))
    collective.counting._count_and_wait(collective.store_client._store_client(), counter, 2, wait=False)
    [(code, out, err)] = outcomes([rank0], TIMEOUT)
    assert budget["left"] == 0 and (code, out) == (0, "every rank counted\n"), err[-3000:]


def test_the_watch_thread_outlasts_a_store_out_of_reach_longer_than_its_retries(monkeypatch, own_collective) -> None:
    """The store out of this rank's reach past STORE_RETRY_SECONDS (a switch rebooting, its host overloaded), its
    host alive (its port does not refuse): before, the watch thread ended for good, so this live rank counted no more
    signs of life - the others named it frozen at their next stall in training (`_frozen`) or lost at the next
    arrival, stopping a healthy launch - and a failure another rank published never reached it. It tries on."""
    collective = own_collective
    store = _as_rank_1(monkeypatch)
    out = {"of_reach": False}
    budget = {"fails": lambda *_: out["of_reach"], "left": float("inf")}
    real = collective.store_client._store_client

    def connect(timeout=10.0):
        if out["of_reach"]:
            raise TimeoutError(f"no store answered within {timeout:.0f} s, the last try: DistStoreError: timeout")
        return FlakyClient(real(timeout), budget)

    patch_where_used(monkeypatch, "_store_client", connect)
    monkeypatch.setattr(collective.timing, "STORE_RETRY_SECONDS", 0.5)
    tries: list[bool] = []
    reconnect = collective.watch._reconnect
    monkeypatch.setattr(collective.watch, "_reconnect", lambda *a: tries.append(reconnect(*a)) or tries[-1])
    exits: list[int] = []
    monkeypatch.setattr(collective.watch.os, "_exit", exits.append)
    collective.watch_failures(2)
    alive = collective.store_client._alive_key(1)
    _wait_for(lambda: store.add(alive, 0) >= 1, "the watch thread never counted this rank alive")
    out["of_reach"] = True
    _wait_for(lambda: False in tries, "the watch thread's reconnect never gave up")
    out["of_reach"] = False
    beats = store.add(alive, 0)
    _wait_for(lambda: store.add(alive, 0) >= beats + 2, "no sign of life once the store was in reach again")
    store.compare_set(collective.store_client._failure_key(), "", "rank 0 ran out of memory in the forward")
    store.set(f"{collective.store_client._failure_key()}/known/0", "1")
    _wait_for(lambda: exits == [1], "a published failure went unseen after the store was out of reach")


def test_a_store_that_accepts_but_never_answers_still_ends_the_watch(monkeypatch, own_collective) -> None:
    """Its host stopped (SIGSTOP, a Ctrl-Z on rank 0's terminal) or hung: each connect tried leaves a thread blocked
    in torch's client until it answers; tried on for ever, a night's stop left hundreds, each with a socket. Such a
    store is given STORE_RETRY_SECONDS, as before, where one out of reach is tried on (above)."""
    collective = own_collective
    _store_host_silent(monkeypatch, collective, agent_store=True)
    stop, watcher = collective.state.run["watcher"]
    _wait_for(lambda: not watcher.is_alive(), "the watch thread tried a silent store on and on")


def _store_host_silent(monkeypatch, collective, agent_store: bool) -> tuple[dict, list[int]]:
    """This rank's watch thread counting alive through a store the test then silences (`silent["on"]`), in a
    launch whose store rank 0 serves (`agent_store` False: a plain env:// launch) or torchrun's agent."""
    store = _as_rank_1(monkeypatch)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", str(agent_store))
    silent = {"on": False}
    budget = {"fails": lambda *_: silent["on"], "left": float("inf")}
    real = collective.store_client._store_client

    def connect(timeout=10.0):
        if silent["on"]:  # as `_connect`'s bound running out on a connect left unanswered
            collective.state.found.silent = "the launch's store at 127.0.0.1 did not answer"
            raise collective.store_client.StoreSilent(collective.state.found.silent)
        return FlakyClient(real(timeout), budget)

    patch_where_used(monkeypatch, "_store_client", connect)
    monkeypatch.setattr(collective.timing, "STORE_RETRY_SECONDS", 0.5)
    monkeypatch.setattr(collective.timing, "LOST_SECONDS", 2.0)
    exits: list[int] = []
    monkeypatch.setattr(collective.watch.os, "_exit", exits.append)
    collective.watch_failures(2)
    alive = collective.store_client._alive_key(1)
    _wait_for(lambda: store.add(alive, 0) >= 1, "the watch thread never counted this rank alive")
    silent["on"] = True
    silent["store"] = store  # held: the server lives with its object
    return silent, exits


def test_a_frozen_rank_0_serving_the_store_is_named_by_the_ranks_stalled_in_training(monkeypatch, own_collective,
                                                                                      capsys) -> None:
    """A plain env:// launch: rank 0 serves the store, so when it freezes (SIGSTOP, a hung node) its store falls
    silent with it, and no peer can read that its signs of life stopped. Before, the peers' watch threads gave up
    on the silent store and the peers, stalled in the gradient all-reduce, waited for the process group's timeout
    (NCCL: 10 minutes, then an abort naming no rank). Now a peer stalled in lockstep for LOST_SECONDS names rank 0."""
    collective = own_collective
    with collective.frozen.lockstep():  # this rank's all-reduce waits for rank 0 from here on
        silent, exits = _store_host_silent(monkeypatch, collective, agent_store=False)
        _wait_for(lambda: exits == [1], "a peer stalled on a frozen store host never named it")
    err = capsys.readouterr().err
    assert "error: rank(s) 0 of 2 gave no sign of life for 2 s while the others waited for them in a training step" \
        in err, err


def test_a_silent_store_outside_training_names_no_rank(monkeypatch, own_collective) -> None:
    """Not in lockstep (no collective waits for rank 0 here): the watch ends as before, naming none."""
    _silent_watch_names_none(monkeypatch, own_collective, agent_store=False, training=False)


def test_a_silent_agent_store_names_no_rank(monkeypatch, own_collective) -> None:
    """torchrun's agent serves the store: rank 0's freeze leaves it answering (the peers' look names rank 0 as any
    peer), and a silent one is no rank's: the watch ends as before, naming none."""
    _silent_watch_names_none(monkeypatch, own_collective, agent_store=True, training=True)


def _silent_watch_names_none(monkeypatch, collective, agent_store: bool, training: bool) -> None:
    with collective.frozen.lockstep() if training else contextlib.nullcontext():
        _silent, exits = _store_host_silent(monkeypatch, collective, agent_store)
        stop, watcher = collective.state.run["watcher"]
        _wait_for(lambda: not watcher.is_alive(), "the watch thread went on against a silent store")
    assert exits == [], exits
