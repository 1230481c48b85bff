"""Check-ahead (store/check_ahead.py): a thread verifies samples ahead of the consumer. The consumer gets the very
same tensors, a damaged sample is refused with the same message as an inline check, the consumer really uses the
thread's results, and no thread outlives the reader or a consumer that stops early."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest
import torch

from damage import flip_bit, key_at, sample_byte
from signal_elsewhere import run_script
from store import Store
from store.integrity import DamagedData
from store_samples import fill
import warm_start


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("check-ahead")]


def _wait(pred, timeout: float = 120.0) -> None:  # a bound for a loaded machine, not a timing assertion
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "check-ahead thread made no progress"
        time.sleep(0.01)


def _flip_sample(root: Path, index: int) -> str:
    key = key_at(root, "vae", index)
    flip_bit(*sample_byte(root, "vae", key, offset=3), 4)
    return key


def test_check_ahead_returns_the_same_tensors_from_the_threads_checks(store: Store, monkeypatch) -> None:
    fill(store, 12)
    inline, ahead = store.reader("vae"), store.reader("vae")
    n = len(ahead)
    checker = ahead.check_ahead(range(n), window=n)
    _wait(lambda: checker.checked == n)
    # Every row was checked by the thread: the consumer must take those results and never check inline.
    monkeypatch.setattr(ahead.checks, "bytes_problem", lambda *a, **k: pytest.fail("checked inline despite check-ahead"))
    for i in range(n):
        a, b = inline.tensors_at(i), ahead.tensors_at(i)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    inline.close()
    ahead.close()
    assert not checker.running and not _threads()


def test_window_bounds_the_thread_and_rows_it_did_not_reach_are_checked_inline(store: Store) -> None:
    fill(store, 12)
    r = store.reader("vae")
    checker = r.check_ahead(range(len(r)), window=3)
    _wait(lambda: checker.checked == 3)
    time.sleep(0.2)
    assert checker.checked == 3  # nothing taken yet: the thread waits at the window
    for i in reversed(range(len(r))):  # against the order: the rows not reached are checked inline
        r.tensors_at(i)
    assert r.checks.checked_count == len(r)
    r.close()
    assert not _threads()


def test_damaged_sample_is_refused_through_check_ahead_with_the_inline_message(store: Store) -> None:
    fill(store, 10)
    key = _flip_sample(store.root, 4)
    inline = store.reader("vae")
    with pytest.raises(DamagedData) as want:
        inline.tensors(key)
    inline.close()
    r = store.reader("vae")
    checker = r.check_ahead(range(len(r)), window=len(r))
    _wait(lambda: checker.checked == len(r))
    for i in range(4):
        r.tensors_at(i)
    with pytest.raises(DamagedData) as got:
        r.tensors_at(4)
    assert str(got.value) == str(want.value) and key in str(got.value) and "pipeline store repair" in str(got.value)
    with pytest.raises(DamagedData):  # refused again on a second read, never returned
        r.tensors_at(4)
    r.close()


def _counting(r, monkeypatch, during=lambda i: None) -> dict[int, int]:
    """Row -> how many times its bytes were CRC-checked (thread and consumer alike); `during(i)` runs inside the
    consumer's own (main thread) checks."""
    counts: dict[int, int] = {}
    real = r.checks.bytes_problem

    def counting(i, *a, **k):
        counts[i] = counts.get(i, 0) + 1
        if threading.current_thread() is threading.main_thread():
            during(i)
        return real(i, *a, **k)

    monkeypatch.setattr(r.checks, "bytes_problem", counting)
    return counts


def test_a_row_the_consumer_checks_itself_is_left_by_the_thread(store: Store, monkeypatch) -> None:
    """The consumer reaches row 0 before the thread (no result: it checks inline); the thread reaches row 0 while
    that check runs. Before, both read and CRC'd its bytes (seen under load in CI: a sample checked twice in a
    training that promises once); now the thread leaves the row the consumer is checking."""
    fill(store, 4)
    r = store.reader("vae")
    go = threading.Event()

    def order():
        go.wait()  # the thread starts only once the consumer is inside its own check of row 0
        yield 0

    checker = r.check_ahead(order(), window=4)

    def let_the_thread_reach_row_0(i: int) -> None:
        go.set()
        _wait(lambda: not checker.running)  # the order is spent: the thread has decided about row 0

    counts = _counting(r, monkeypatch, let_the_thread_reach_row_0)
    r.tensors_at(0)
    assert counts == {0: 1}
    r.close()


def test_a_damaged_row_found_by_the_consumer_is_not_checked_again_by_the_thread(store: Store, monkeypatch) -> None:
    """Train's order is endless (every epoch): a damaged row the consumer met inline (the thread had not reached
    it) came round again in the thread's order and was read and CRC'd again; now the consumer tells the thread."""
    fill(store, 6)
    _flip_sample(store.root, 2)
    r = store.reader("vae")
    go = threading.Event()

    def order():
        go.wait()  # nothing ahead until the consumer has met row 2 itself
        yield from itertools.cycle(range(len(r)))

    checker = r.check_ahead(order(), window=2)
    counts = _counting(r, monkeypatch)
    with pytest.raises(DamagedData):
        r.tensors_at(2)
    go.set()
    for i in (0, 1, 3, 4, 5):  # the consumer goes on (taking the thread's results: its window moves)
        r.tensors_at(i)
    _wait(lambda: not checker.running)  # every row done (checked, or damaged): the endless order ends the thread
    assert counts[2] == 1, counts
    r.close()


def test_no_thread_left_when_the_consumer_stops_early(store: Store) -> None:
    fill(store, 8)
    r = store.reader("vae")
    checker = r.check_ahead(itertools.cycle(range(len(r))), window=2)  # an endless order (train: every epoch)
    for i in range(3):
        r.tensors_at(i)
    r.stop_check_ahead()
    assert not checker.running and not _threads()
    r.tensors_at(5)  # reading goes on, checked inline
    joined = Store(store.root).reader("vae")
    joined.check_ahead(itertools.cycle(range(len(joined))), window=2)
    joined.close()  # closing the reader ends its thread too
    assert not _threads()
    r.close()


def test_joined_check_ahead_walks_each_tables_own_rows(store: Store) -> None:
    """Two tables whose row numbers differ (one holds extra keys): each thread checks its own table's rows of
    the joined samples, in the joined order."""
    from dataclasses import replace

    from store.join import JoinedTables
    from store_samples import sample, vae_schema

    for table, indices in (("left", range(0, 10)), ("right", range(3, 12))):
        w = store.writer(table, replace(vae_schema(), name=table), shard_size_mb=0.004)
        for i in indices:
            s = sample(i)
            w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
        w.commit()
    joined = JoinedTables({t: store.reader(t) for t in ("left", "right")})
    assert len(joined) == 7 and not (joined.rows["left"] == joined.rows["right"]).all()
    order = list(reversed(range(len(joined))))
    joined.check_ahead(lambda: iter(order), window=len(order))
    for t, r in joined.readers.items():
        _wait(lambda r=r: r._ahead.checked == len(order))
        assert list(r._ahead._results) == [int(joined.rows[t][i]) for i in order]
    joined.stop_check_ahead()
    assert not _threads()


def test_an_endless_order_ends_the_thread_once_every_row_is_checked(store: Store) -> None:
    """Train's read order repeats over epochs forever: once every row it yields is checked, the thread ends
    (it used to walk the endless order at full speed, taking a core from the training)."""
    fill(store, 12)
    r = store.reader("vae")
    n = len(r)
    checker = r.check_ahead(itertools.cycle(range(n)), window=4)
    for i in range(n):  # the consumer reads one epoch
        r.tensors_at(i)
    _wait(lambda: not checker.running)
    assert checker.checked <= n and r.checks.checked_count == n
    r.close()
    # a damaged row never becomes "checked": the thread remembers it, so a consumer that skips it epoch after
    # epoch does not make the thread check it again each epoch (and walk the plan between)
    bad = store.reader("vae").keys().index(_flip_sample(store.root, 4))
    r = store.reader("vae", on_damaged="skip")
    checker = r.check_ahead(itertools.cycle(range(n)), window=4)
    for i in [i for _ in range(3) for i in range(n) if i != bad]:  # three epochs
        r.tensors_at(i)
    _wait(lambda: not checker.running)
    assert checker.checked <= n and r.checks.checked_count == n - 1
    r.close()


def test_a_shard_cut_short_under_a_checking_reader_is_damaged_data_not_sigbus(store: Store, tmp_path) -> None:
    """The check-ahead thread has read part of a shard when the file is truncated under the reader: the rest of
    its rows are `DamagedData` (the thread and the consumer read by pread), never SIGBUS. The thread used to map
    the shard and touch pages past the new end. In a subprocess: a SIGBUS fails this test instead of killing
    pytest."""
    import os
    import sys

    fill(store, 12, shard_size_mb=0.02)
    script = f"""
import os, time
from store import Store
from store.integrity import DamagedData
r = Store({str(store.root)!r}).reader("vae")
shard = r.view.samples.shard_of(0)
rows = [i for i in range(len(r)) if r.view.samples.shard_of(i) == shard]
assert len(rows) >= 3, rows
checker = r.check_ahead(rows, window=1)
while checker.checked < 1:  # the thread has read the shard's first row and waits at the window
    time.sleep(0.01)
os.truncate(r.dir / shard, r.view.samples.locate(rows[1])[1] + 1)
try:
    for i in rows:
        r.tensors_at(i)
except DamagedData as e:
    print("DamagedData:", str(e).splitlines()[0])
r.close()
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = warm_start.run([sys.executable, "-c", script], env=env, timeout=120)  # started warm (tests/warm_start.py)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7: SIGBUS
    assert done.stdout.startswith("DamagedData:") and "bytes before the sample does" in done.stdout, done.stdout


HOLD_SECONDS = 30  # how long the stalled row's check holds out: far above what a passing run needs under load

STALLED_ROW = """
import signal, sys, tempfile, threading
from pathlib import Path
from signal_elsewhere import signal_elsewhere_once_main_waits
from store.check_ahead import CheckAhead

started, checked = threading.Event(), threading.Event()

class StalledCheck:  # row 0's bytes come slowly (its shard fetched whole from a URL, a hung network disk)
    view = [0]

    def is_checked(self, i):
        return False

    def problem(self, i, files):
        started.set()
        threading.Event().wait(HOLD_SECONDS)
        checked.set()
        return None

ahead = CheckAhead(StalledCheck(), Path(tempfile.mkdtemp()), [0])
started.wait()  # the thread is on row 0: the consumer's take(0) waits for it
try:
    signal_elsewhere_once_main_waits(CALL, signal.SIGINT)
    ahead.take(0) if CALL == "take" else ahead.close()
except KeyboardInterrupt:
    print("interrupted", "after the row's check" if checked.is_set() else "while the row was checked")
    sys.exit(130)
"""


@pytest.mark.parametrize("call", ["take", "close"])
def test_ctrl_c_ends_a_consumer_waiting_for_the_row_the_thread_checks(call: str) -> None:
    """The SIGINT goes to another thread than the main one, as Linux may deliver a Ctrl-C (the check-ahead thread
    busy reading takes it as often as not; tests/signal_elsewhere.py): the consumer's untimed wait for the row
    the thread was on (`take`, or `close` joining the thread: a command's cleanup) never woke for it, and a row
    whose shard came slowly held the stop that long."""
    proc = run_script(f"HOLD_SECONDS, CALL = {HOLD_SECONDS}, {call!r}\n" + STALLED_ROW, timeout=HOLD_SECONDS + 120)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stdout.strip() == "interrupted while the row was checked"
