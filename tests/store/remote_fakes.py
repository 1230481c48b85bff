"""Stand-ins the remote-store tests put around store/remote_*.py's I/O (not a test module itself): a progress bar
that counts nothing, a response body cut off mid-way, a local file that runs a check before each read."""

from __future__ import annotations

from typing import Callable

from urllib3.exceptions import IncompleteRead

from store import remote as remote_mod


class NoBar:
    def update(self, n: int = 1) -> None:
        pass


class CutBody:
    """A response body that breaks once, after its first piece, as a connection reset mid-body does (`cut`: the
    bytes served before the break are appended to it; a list shared by bodies breaks only the first one)."""

    def __init__(self, body, cut: list[int] | None = None) -> None:
        self.body, self.cut, self.served = body, [] if cut is None else cut, 0

    async def read(self, n: int) -> bytes:
        if self.served >= remote_mod.READ_PIECE and not self.cut:
            self.cut.append(self.served)
            raise IncompleteRead(self.served, 1)
        got = await self.body.read(n)
        self.served += len(got)
        return got

    def close(self) -> None:
        self.body.close()


class CheckedFile:
    """A local file remote_upload opens (patched in as its `open`): `before_read(n)` runs before each read."""

    def __init__(self, f, before_read: Callable[[int], None]) -> None:
        self.f, self.before_read = f, before_read

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()

    def fileno(self) -> int:
        return self.f.fileno()

    def read(self, n: int = -1) -> bytes:
        self.before_read(n)
        return self.f.read(n)
