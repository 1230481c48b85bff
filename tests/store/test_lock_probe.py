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
