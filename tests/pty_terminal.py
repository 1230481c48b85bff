"""A pseudo-terminal for tests of what is drawn on a terminal (tests/pipeline/test_log_bars.py,
tests/pipeline/test_sizeless_terminal.py): its side as a text stream, what was written there read back."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import struct
import termios
from collections.abc import Iterator


class Terminal:
    def __init__(self, main: int, stream) -> None:
        self._main = main
        self.stream = stream  # the terminal's side: a text stream, `.fileno()` for a child process's stderr

    def drawn(self) -> str:
        """What was written on the terminal since the last call (this process's writes flushed first)."""
        self.stream.flush()
        out = b""
        while select.select([self._main], [], [], 0.1)[0]:
            try:
                chunk = os.read(self._main, 65536)
            except OSError:  # EIO: the terminal's side closed, all read
                break
            if not chunk:
                break
            out += chunk
        return out.decode()


@contextlib.contextmanager
def pty_terminal(columns: int | None = 100, rows: int = 24) -> Iterator[Terminal]:
    """A terminal of `columns` x `rows`; `columns` None: no size set, 0 x 0 as a new pty reports."""
    main, side = os.openpty()
    if columns is not None:
        fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    stream = os.fdopen(side, "w")
    try:
        yield Terminal(main, stream)
    finally:
        stream.close()
        os.close(main)
