"""`fmt.refuse_if_held`: the check an encode makes before its model loads, that another process holds the table's
writer lock. It names the holder from the lock file; a holder unlinking the file as it lets go, between the probe's
open and its read, still gives the one line (before: the path read again, FileNotFoundError, a traceback)."""

from __future__ import annotations

import fcntl
import os

import pytest

from schemas.errors import UserError
from store import format as fmt


def _held(path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"pid 4242 on node-a")
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_held_lock_is_refused_naming_its_holder_and_a_free_one_passes(tmp_path):
    path = tmp_path / ".write.lock"
    fmt.refuse_if_held(path, "table 'vae'")  # no file: never taken
    fd = _held(path)
    try:
        with pytest.raises(UserError, match=r"table 'vae' is being written by pid 4242 on node-a"):
            fmt.refuse_if_held(path, "table 'vae'")
    finally:
        os.close(fd)
    fmt.refuse_if_held(path, "table 'vae'")  # let go: nobody holds it


def test_a_holder_unlinking_its_lock_as_the_probe_reads_it_is_still_one_line(tmp_path, monkeypatch):
    path = tmp_path / ".write.lock"
    fd = _held(path)
    real = fcntl.flock

    def probe_then_unlinked(f, op):
        try:
            real(f, op)
        finally:
            path.unlink(missing_ok=True)  # the holder lets go meanwhile, unlinking its file

    monkeypatch.setattr(fcntl, "flock", probe_then_unlinked)
    try:
        with pytest.raises(UserError, match=r"being written by pid 4242 on node-a"):
            fmt.refuse_if_held(path, "table 'vae'")
    finally:
        os.close(fd)


def test_a_writer_that_takes_the_lock_right_after_the_probe_is_still_refused_by_the_writers_lock(tmp_path):
    """The probe takes nothing: a second writer that takes the lock between the probe and the writer's open (the
    minutes of a model load) is refused by `lock_rank`'s own non-blocking lock, which the writer takes before it
    writes anything (store/writer.py). The probe is only the early line, not the guard."""
    from store.writer_open import lock_rank, refuse_a_running_writer

    (tmp_path / "vae").mkdir()
    refuse_a_running_writer(tmp_path, "vae", 0)  # nobody holds it
    fd = _held(tmp_path / "vae" / ".write-r00.lock")  # another writer came meanwhile
    try:
        with pytest.raises(UserError, match=r"table 'vae' \(rank 0\) is being written by pid 4242 on node-a"):
            lock_rank(tmp_path, "vae", 0)
    finally:
        os.close(fd)


def test_a_probe_is_no_holder_to_another_probe(tmp_path):
    """Every probe of a lock (an encode's early check, gc's look for live writers, the look for a live repair on a
    URL's working copy) is `fmt.lock_holder`'s shared one: two probes at once never see each other as a holder.
    Before, gc's look took the lock exclusively: while an encode's check probed a table's lock, gc took it for a
    live writer (and kept that table's versions past the current one), and an encode's check that came during
    gc's look was refused as if a writer held it."""
    from store.gc import _writer_active

    table = tmp_path / "vae"
    table.mkdir()
    lock = table / ".write-r00.lock"
    lock.write_text("pid 4242 on node-a")  # its last holder, long gone
    probe = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # another probe, mid-look
        assert not _writer_active(table) and fmt.lock_holder(lock) is None
        fmt.refuse_if_held(lock, "table 'vae'")
    finally:
        os.close(probe)
    fd = _held(lock)  # a writer
    try:
        assert _writer_active(table) and fmt.lock_holder(lock) == "pid 4242 on node-a"
    finally:
        os.close(fd)


def test_a_writer_taking_its_lock_during_a_probe_is_not_refused(tmp_path, monkeypatch):
    """A probe (gc's look for live writers, another rank's early check) holds a table's writer lock shared for its
    look; a writer taking that lock right then was refused, naming the lock's last holder (long gone). It tries
    again for a moment: the look is over by then (here: the probe lets go at the writer's first pause)."""
    from types import SimpleNamespace

    from store.writer_open import lock_rank

    (tmp_path / "vae").mkdir()
    lock = tmp_path / "vae" / ".write-r00.lock"
    lock.write_text("pid 4242 on node-a")  # its last holder, long gone
    probe = [os.open(lock, os.O_RDONLY)]
    fcntl.flock(probe[0], fcntl.LOCK_SH | fcntl.LOCK_NB)  # gc's look, mid-probe

    def look_over(seconds):
        while probe:
            os.close(probe.pop())

    monkeypatch.setattr(fmt, "time", SimpleNamespace(sleep=look_over), raising=False)
    try:
        lock_rank(tmp_path, "vae", 0).release()
    finally:
        look_over(0)
