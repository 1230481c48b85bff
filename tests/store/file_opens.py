"""How many times each file of a folder is opened, counted by the kernel (inotify IN_OPEN): every open counts,
whichever layer makes it (Python's open, pyarrow's C++ readers, os.open), which wrapping one function would miss.
Closes are watched too: inotify merges an event with the one before it when they are the same, so two opens of a
file one after the other would count as one without the close between them."""

from __future__ import annotations

import ctypes
import os
import struct
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

IN_CLOSE_WRITE, IN_CLOSE_NOWRITE, IN_OPEN, IN_Q_OVERFLOW = 0x8, 0x10, 0x20, 0x4000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name


@contextmanager
def opens(folder: Path) -> Iterator[Counter]:
    """A Counter of file name -> opens in `folder` (not below it) while the block runs, filled when it ends."""
    if not sys.platform.startswith("linux"):
        pytest.skip("counts opens with inotify (Linux)")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0 or libc.inotify_add_watch(fd, os.fsencode(folder), IN_OPEN | IN_CLOSE_WRITE | IN_CLOSE_NOWRITE) < 0:
        raise OSError(ctypes.get_errno(), f"inotify on {folder}")
    counts: Counter = Counter()
    try:
        yield counts
        while True:
            try:
                buf = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            at = 0
            while at < len(buf):
                _, mask, _, n = _EVENT.unpack_from(buf, at)
                assert not mask & IN_Q_OVERFLOW, "inotify's queue overflowed: opens were lost"
                name = buf[at + _EVENT.size : at + _EVENT.size + n].rstrip(b"\0").decode()
                if name and mask & IN_OPEN:  # no name: the folder itself was opened (a listing)
                    counts[name] += 1
                at += _EVENT.size + n
    finally:
        os.close(fd)
