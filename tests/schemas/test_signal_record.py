"""schemas.interruptible's record of the signals a process received belongs to one run of the CLI's entry point:
a second run in the same process (a test's in-process `main()`, a notebook) starts with none received, and the
pipe of the run before is closed rather than left open for the process life."""

from __future__ import annotations

import os
import signal

import pytest

from schemas import interruptible


@pytest.fixture
def fresh_record(monkeypatch):
    monkeypatch.setattr(interruptible, "_received", {"fd": None, "seen": set(), "write": None})
    previous = signal.set_wakeup_fd(-1)
    yield
    signal.set_wakeup_fd(previous)
    for name in ("fd", "write"):
        if interruptible._received.get(name) is not None:
            os.close(interruptible._received[name])


def test_a_second_record_starts_with_no_signal_received_and_closes_the_first_pipe(fresh_record) -> None:
    interruptible.record_signals()
    first = interruptible._received["fd"]
    first_pipe = os.fstat(first).st_ino
    interruptible.note_signal(signal.SIGINT)  # the first run's Ctrl-C
    assert interruptible.received(signal.SIGINT)
    interruptible.record_signals()  # a second run in this process
    assert not interruptible.received(signal.SIGINT), "the first run's Ctrl-C read as the second's"
    try:  # closed, not left to the process's end (its number may be another file's since)
        assert os.fstat(first).st_ino != first_pipe, "the first run's pipe is still open"
    except OSError:
        pass


def test_a_signal_handled_while_the_record_is_read_on_the_same_thread_does_not_hang(monkeypatch) -> None:
    """The CLI's handlers note each signal (`note_signal`) on the main thread, between any two bytecodes of it: also
    inside `received` there (the CLI's `user_errors` asks it), which holds the record's lock. A lock that one thread
    cannot take twice hung that process for good on a second Ctrl-C. Here the handler's call is made inside the
    lock on one thread, as the signal would make it."""
    import threading

    monkeypatch.setattr(interruptible, "_received", {"fd": None, "seen": set(), "write": None})
    monkeypatch.setattr(interruptible, "_received_lock", type(interruptible._received_lock)())

    def reading_when_signalled() -> None:
        with interruptible._received_lock:  # `received` mid-read
            interruptible.note_signal(signal.SIGINT)  # the handler, run on the same thread

    worker = threading.Thread(target=reading_when_signalled, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the signal's handler waits for a lock its own thread holds"
    assert interruptible.received(signal.SIGINT)
