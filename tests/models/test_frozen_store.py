"""A launched rank stopped by a Ctrl-C before its first exchange publishes its stop through the launch's store
(models/collective/interrupt.py `publish_interrupt`). Where the store's host accepts connections but never answers
(stopped by SIGSTOP, hung), torch's client ignores its timeout: the rank printed its stop line and then never exited, a
second Ctrl-C and a SIGTERM both ignored (the main thread blocked in one C++ call), only SIGKILL ended it. Now the
connect runs in a thread of its own, waited for within our bound: the rank says in one line that it could not tell
the others and exits 130; a SIGTERM during that wait ends it at once (143). So does a Ctrl-C of a rank waiting at
its first exchange for such a store (its connect: 30 minutes, torch's timeout ignored). One process of its own per
case, started warm (tests/warm_start.py), against a plain listening socket that never answers."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from own_collective import own_collective  # noqa: F401  (the fixture)
from schemas.errors import UserError
from warm_start import WarmProcess

RANK_SCRIPT = Path(__file__).with_name("rank_frozen_store.py")
BOUND = 30.0  # generous, for a loaded machine; before the fix neither case ended within any bound


def _silent_store() -> socket.socket:
    """A port that accepts connections (the kernel's handshake, as for a stopped process) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    return listener


def _rank_1(port: int, connect_seconds: float, *mode: str) -> WarmProcess:
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    return WarmProcess([sys.executable, str(RANK_SCRIPT), str(connect_seconds), *mode], env=env)


def _wait_ready(proc: WarmProcess) -> None:
    deadline = time.monotonic() + BOUND
    while "ready" not in proc.output()[0]:
        assert proc.poll() is None, proc.output()
        assert time.monotonic() < deadline, "the rank never started its command"
        time.sleep(0.05)


@pytest.mark.parametrize("then", ["nothing", "sigterm", "exchange"])
def test_a_ctrl_c_against_a_store_that_never_answers_still_ends_the_rank(then) -> None:
    listener = _silent_store()
    port = listener.getsockname()[1]
    # "nothing": a short bound, the exit comes once it ran out; "sigterm": a long one, which the SIGTERM cuts short;
    # "exchange": the Ctrl-C comes while the rank waits for the store's answer at its first exchange
    proc = _rank_1(port, 3600.0 if then == "sigterm" else 1.0, *(["exchange"] if then == "exchange" else []))
    try:
        _wait_ready(proc)
        if then == "exchange":
            time.sleep(0.5)  # connecting by now (any moment of the wait works: no race)
        proc.send_signal(signal.SIGINT)
        if then == "sigterm":
            deadline = time.monotonic() + BOUND
            while "stopped by SIGINT" not in proc.output()[1]:  # its stop line: it is publishing now
                assert proc.poll() is None and time.monotonic() < deadline, proc.output()
                time.sleep(0.05)
            time.sleep(0.5)  # inside the publish's connect (a wait of its own, not a race: any moment of it works)
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(BOUND)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: the defect
            pytest.fail(f"the rank did not end within {BOUND:.0f} s of its Ctrl-C ({then}): {proc.output()}")
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()
    out, err = proc.output()
    assert "Traceback" not in err, err
    assert "stopped by SIGINT (Ctrl-C)" in err, err
    if then != "sigterm":
        assert proc.returncode == 130, (proc.returncode, err)
        last = err.rstrip().splitlines()[-1]
        assert re.fullmatch(rf"rank 1 could not tell the other ranks: the launch's store at 127\.0\.0\.1:{port} "
                            r"accepts connections but did not answer within \d+ s \(its host is stopped, hung or "
                            r"unreachable\); they stop at their own timeout", last), err
    else:
        assert proc.returncode == 143, (proc.returncode, err)


_STORE_HOST = """
import time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
print(store.port, flush=True)
time.sleep(600)
"""


def _timed_out(client):
    raise RuntimeError("Wait timeout")  # torch's own timeout, where it applied: the call returned, the store silent


@pytest.mark.parametrize("read", ["blocks", "times out"])
def test_a_wait_through_a_store_whose_host_stopped_ends_in_one_line(monkeypatch, own_collective, read) -> None:
    """A rank waiting through the store (`arrive_together`, `main_alone`: models/collective/reconnect.py `_read`) when
    the store's host stops answering mid-run (a Ctrl-Z on rank 0's terminal, a hung node): torch's call blocked for
    ever, ignoring its timeout (a Ctrl-C too). Now each call is bounded, the store tried again (`_reconnect`), then
    the wait ends in one line (`StoreSilent`, a `UserError`). The host is a real store in a process of its own,
    stopped by SIGSTOP; this process plays rank 1 of 2."""
    collective = own_collective
    host = WarmProcess([sys.executable, "-c", _STORE_HOST], env={**os.environ})
    try:
        deadline = time.monotonic() + BOUND
        while not _port(host):
            assert host.poll() is None and time.monotonic() < deadline, host.output()
            time.sleep(0.05)
        port = _port(host)
        for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(collective.timing, "CONNECT_SECONDS", 1.0)  # the bounds, short: an end in seconds
        monkeypatch.setattr(collective.timing, "STORE_RETRY_SECONDS", 2.0)
        clients = [collective.store_client._store_client(2.0)]
        assert not _call_read(collective, clients, BOUND), "the store answered no call while it ran"
        host.send_signal(signal.SIGSTOP)
        _wait_stopped(host.pid, BOUND)  # (a stop lands when the host's threads are next scheduled: CI saw it answer)
        # the first failed call's own error, torch's timeout too, ends in the same line (before, a race between
        # torch's timeout and our bound could end in torch's error)
        outcome = _call_read(collective, clients, BOUND, None if read == "blocks" else _timed_out)
    finally:
        host.send_signal(signal.SIGCONT)
        _answered(BOUND)
        host.kill()
    assert outcome != "blocked", f"the wait's call did not end within {BOUND:.0f} s of the store's host stopping"
    assert isinstance(outcome, collective.StoreSilent), outcome
    assert isinstance(outcome, UserError) and "\n" not in str(outcome)
    assert str(outcome).startswith(f"the launch's store at 127.0.0.1:{port} accepts connections but did not answer "
                                   "within 2 s (its host is stopped, hung or unreachable)"), outcome


def _wait_stopped(pid: int, bound: float) -> None:
    """Until every thread of process `pid` is stopped (state T in /proc), at most `bound` seconds."""
    deadline = time.monotonic() + bound
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rpartition(")")[2].split()[0])
            except FileNotFoundError:  # a thread that ended
                pass
        if states and all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped within {bound:.0f} s: {states}"
        time.sleep(0.01)


def _port(proc: WarmProcess) -> int:
    out = proc.output()[0].strip()
    return int(out) if out.isdigit() else 0


def _call_read(collective, clients: list, bound: float, read=None):
    """`_read(clients, read or check a key)` in a thread of its own, waited for `bound` seconds: its result or
    error, or "blocked"."""
    import threading

    outcome: list = ["blocked"]

    def wait() -> None:
        try:
            outcome[0] = collective.reconnect._read(clients, read or (lambda c: c.check(["never-set"])))
        except Exception as e:  # noqa: BLE001 - the test's outcome
            outcome[0] = e

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(bound)
    return outcome[0]


def _answered(bound: float) -> None:
    """Wait (at most `bound` seconds) until the calls left blocked on the stopped store (`_in_thread`'s threads) have
    their answer from the store resumed: ended after its host, each printed c10d's warning and stack here."""
    import threading

    deadline = time.monotonic() + bound
    while any(t.name == "store-call" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_store_call_where_no_thread_can_start_runs_in_place_and_is_tried_again(monkeypatch, own_collective):
    """At the interpreter's shutdown (Python 3.12: an atexit handler too, the exit's count) no thread starts: the
    call runs in place. A failed connect there is tried afresh by the next try (`_connect`'s `pending` kept the
    first one's error for every later try before, so a store up a moment later was never reached)."""
    import threading

    collective = own_collective
    calls = collective.store_client

    def refused(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refused)
    assert calls._outcome(calls._in_thread(lambda: 5), 1.0, "h:p") == 5
    collective.state.run["store_silent"] = "silent"  # found silent: no unbounded call in place against it
    with pytest.raises(collective.StoreSilent):
        calls._outcome(calls._in_thread(lambda: pytest.fail("called in place")), 1.0, "h:p")
    del collective.state.run["store_silent"]
    tries, pending = [], []

    def connect_once_refused(*a, **k):
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("not up yet")
        return "client"

    import torch.distributed as dist

    monkeypatch.setattr(dist, "TCPStore", connect_once_refused)
    with pytest.raises(RuntimeError, match="not up yet"):
        calls._connect("127.0.0.1", 1, 1.0, pending)
    assert calls._connect("127.0.0.1", 1, 1.0, pending) == "client" and len(tries) == 2


class SlowStore:
    """A live store's client whose every call takes `seconds` (a store busy with 512 ranks' polls), with a bound
    (`timeout`) that one call keeps well within and a rank's batch of them does not."""

    def __init__(self, seconds: float, bound: float) -> None:
        self.seconds, self.timeout, self.values = seconds, timedelta(seconds=bound), {}

    def _op(self):
        time.sleep(self.seconds)

    def set(self, key: str, value: str) -> None:
        self._op()
        self.values[key] = 1

    def check(self, keys: list[str]) -> bool:
        self._op()
        return all(k in self.values for k in keys)

    def add(self, key: str, n: int) -> int:
        self._op()
        self.values[key] = self.values.get(key, 0) + n
        return self.values[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._op()
        return [str(self.values[k]).encode() for k in keys]

    def append(self, key: str, value: str) -> None:
        self._op()
        self.values[key] = self.values.get(key, "") + value

    def get(self, key: str) -> bytes:
        self._op()
        return str(self.values[key]).encode()


def test_a_wait_of_many_ranks_on_a_busy_store_bounds_each_call_not_the_batch(monkeypatch, own_collective) -> None:
    """`arrive_together` looks at every rank not arrived (`_lost_ranks`: two calls per rank; `_wait_notice`: one in all)
    through a store whose calls take 2 ms each: 512 ranks' batch takes ~2 s, past a bound of 1 s. Bounded as a
    whole, the batch ended in `StoreSilent`, a new connection (`_reconnect`) and the same batch again (for ever
    where the store answers, each lap leaving a blocked thread and a connection); each call bounded on its own, the
    wait ends when the last rank arrives."""
    collective, world = own_collective, 512
    store = SlowStore(0.002, 0.01)  # the bound: 0.01 s and `_outcome`'s second more
    for name, value in {"RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    laps: list[int] = []

    def reconnect(clients, stop) -> bool:
        laps.append(1)
        return len(laps) < 3  # a store that answers again, twice: then the wait ends (for ever before)

    monkeypatch.setattr(collective.arrive, "watch_failures", lambda world: None)
    monkeypatch.setattr(collective.arrive, "_store_client", lambda timeout=10.0: store)
    monkeypatch.setattr(collective.reconnect, "store_host_gone", lambda: False)  # `_read`'s
    monkeypatch.setattr(collective.reconnect, "_reconnect", reconnect)
    monkeypatch.setattr(collective.timing, "WAIT_NOTICE_SECONDS", 0.0)  # the notice's batch at the first look too
    monkeypatch.setattr(collective.timing, "POLL_SECONDS", 0.01)
    counts = iter([1, world])  # rank 0 alone at the first look, all arrived at the next
    add = store.add
    monkeypatch.setattr(store, "add", lambda key, n: next(counts) if n == 0 and "/arrived/" in key else add(key, n))
    began = time.monotonic()
    collective.arrive_together(world, "checkpoint write")
    assert laps == [], f"a batch was tried again {len(laps)} time(s) after {time.monotonic() - began:.1f} s"


@pytest.mark.parametrize("store", ["answers", "silent"])
def test_an_exit_after_a_stall_counts_itself_where_the_store_answers_again(monkeypatch, own_collective, store):
    """The watch thread's last poll before the exit met a stall (`store_silent`), and its new connection was cut
    short by the exit (`store_lost`). The exit's count (`_count_exit`) skipped such a store for good, though the
    stall had passed: the store's host waited for this rank its whole bound. Now one short try: a store that
    answers counts the rank; one still silent costs the try's bound (PROBE_SECONDS and a second), not more."""
    from test_failure_lines import _as_rank_1

    collective = own_collective
    live = _as_rank_1(monkeypatch)
    listener = _silent_store()
    if store == "silent":
        monkeypatch.setenv("MASTER_PORT", str(listener.getsockname()[1]))
    collective.state.run.update(store_silent="a stall", store_lost=True)
    began = time.monotonic()
    try:
        collective.exit._count_exit(None, 2)
        took = time.monotonic() - began
    finally:
        collective.forget_store_hosts()
        listener.close()
        _answered(BOUND)
    if store == "answers":
        assert live.check([f"{collective.store_client._launch_key('exited')}/1"]), "this rank's exit was not counted"
    else:
        assert took < collective.timing.PROBE_SECONDS + 3, f"the exit waited {took:.1f} s for a silent store"


def test_a_wait_says_the_store_is_silent_though_the_watch_thread_was_answered_meanwhile(monkeypatch, own_collective):
    """A main thread's wait (`_read`) whose call failed on torch's timeout, and whose new connection's tries
    (`_reconnect`) got no answer, ends in the store's one line (`StoreSilent`). The finding was one flag of the
    process, which the watch thread's poll answered meanwhile cleared: the wait then ended in torch's error. The
    interleaving is driven in order here: the main thread's silent try, then the watch thread's answered poll."""
    import threading

    collective = own_collective
    calls = collective.store_client
    listener = _silent_store()  # the port answers `_reconnect`'s probe
    port = listener.getsockname()[1]
    for name, value in {"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    never = threading.Event()

    def silent_connect(timeout=10.0):
        # this (main) thread's try: the store accepted the connection and never answered
        with pytest.raises(collective.StoreSilent):
            calls._outcome(calls._in_thread(never.wait), 0.0, f"127.0.0.1:{port}")
        # then the watch thread's poll, answered
        watch = threading.Thread(target=calls._outcome, args=(calls._in_thread(lambda: False), 1.0, "h:p"))
        watch.start()
        watch.join()
        raise collective.StoreSilent("still silent")

    class Client:
        timeout = timedelta(seconds=2)

    monkeypatch.setattr(collective.reconnect, "store_host_gone", lambda: False)  # `_read`'s
    monkeypatch.setattr(collective.reconnect, "_store_client", silent_connect)  # `_reconnect`'s
    monkeypatch.setattr(collective.timing, "STORE_RETRY_SECONDS", 1.0)  # one try (it takes a second), then given up
    try:
        with pytest.raises(collective.StoreSilent) as raised:
            collective.reconnect._read([Client()], _timed_out)
    finally:
        never.set()
        listener.close()
    assert str(raised.value) == (f"the launch's store at 127.0.0.1:{port} accepts connections but did not answer "
                                 "within 1 s (its host is stopped, hung or unreachable)")


def test_a_wait_whose_store_was_silent_then_refused_says_its_host_ended(monkeypatch, own_collective):
    """`_reconnect`'s first try met a silent store (this thread's finding set), its next a refused connection (the
    store's host ended meanwhile): the wait said the store "accepts connections but did not answer", which it no
    longer did. The tries are driven in order here: the probe answers then is refused, the connect is silent."""
    import torch.distributed as dist

    collective = own_collective
    calls = collective.store_client
    for name, value in {"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    probes = []

    class Probe:
        def close(self):
            pass

    def create_connection(where, timeout=None):
        probes.append(where)
        if len(probes) > 1:
            raise ConnectionRefusedError("the store's host ended")
        return Probe()

    def silent_connect(timeout=10.0):
        state = collective.state
        state.run["store_silent"] = state.found.silent = calls._silent_line("127.0.0.1:1", 1.0)
        raise collective.StoreSilent(state.found.silent)

    class Client:
        timeout = timedelta(seconds=2)

    monkeypatch.setattr(collective.reconnect, "store_host_gone", lambda: False)  # `_read`'s first look
    monkeypatch.setattr(collective.reconnect.socket, "create_connection", create_connection)
    monkeypatch.setattr(collective.reconnect, "_store_client", silent_connect)
    monkeypatch.setattr(collective.timing, "POLL_SECONDS", 0.01)
    with pytest.raises(dist.DistNetworkError) as raised:
        collective.reconnect._read([Client()], _timed_out)
    assert len(probes) == 2
    assert "process ended" in str(raised.value) and "did not answer" not in str(raised.value)
