"""A local parquet file read for the first time (first_read.py) is hashed from the bytes its reader reads, so a
first run reads it once, not twice (the hash pass, then the rows).

pyarrow does not read a file front to back: it reads each mapped column's chunks at its own pace (a batch of rows
takes a buffer of the target column, then of each control column, ...), and skips unmapped columns. sha256 needs
the bytes in order, so this file object, which pyarrow reads through, reads the file in one sequential pass of
its own: a read past the hashed part hashes everything up to its end (skipped columns included) and keeps those
bytes, so the reads behind it (the other columns of the same row groups) are served from memory, not the disk.
The reader releases what lies before the row group its next batch starts in (`release`), so what is kept is about
one or two row groups of the file (HF datasets writes image datasets in row groups of 100 rows); never more than
`KEEP` bytes: a larger row group's oldest kept bytes are dropped and, if read after all, read again from the file
(correct, only more I/O). `finish` hashes the rest (unmapped trailing columns, the footer): `digest` is then the
whole file's sha256.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

KEEP = 256 << 20  # the most bytes kept for the reads behind the hashed part
CHUNK = 1 << 20


class HashedParquet(io.RawIOBase):
    """A seekable read-only file pyarrow reads; every byte of it hashed in order, read from the disk once."""

    def __init__(self, path: str | Path, keep: int = KEEP) -> None:
        super().__init__()
        self.raw = open(path, "rb", buffering=0)  # noqa: SIM115 - closed with this object
        self.size = self.raw.seek(0, io.SEEK_END)
        self.keep, self.pos, self.whole = keep, 0, False
        self._h, self._hashed = hashlib.sha256(), 0  # bytes [0, _hashed) are in the hash
        self._kept, self._kept_at = bytearray(), 0  # bytes [_kept_at, _hashed), for the reads behind

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = offset if whence == io.SEEK_SET else self.pos + offset if whence == io.SEEK_CUR else \
            self.size + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        start = self.pos
        end = self.size if n is None or n < 0 else min(start + n, self.size)
        if end <= start:
            return b""
        if end > self._hashed and start < self._hashed + self.keep:  # next in order (a skipped column at most)
            self._advance(end)
        if start >= self._kept_at and end <= self._hashed:
            with memoryview(self._kept) as kept:  # one copy (a bytearray slice is a copy of its own)
                out = bytes(kept[start - self._kept_at:end - self._kept_at])
        else:  # dropped already (a row group over KEEP), or far ahead: from the file (hashed in its turn)
            self.raw.seek(start)
            out = self.raw.read(end - start)
        self.pos = start + len(out)
        return out

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def release(self, below: int) -> None:
        """The reader needs no byte before `below` any more."""
        if below > self._kept_at:
            del self._kept[:min(below, self._hashed) - self._kept_at]
            self._kept_at = max(self._kept_at, min(below, self._hashed))

    def _advance(self, end: int, keep: bool = True) -> None:
        self.raw.seek(self._hashed)
        while self._hashed < end:
            b = self.raw.read(min(CHUNK, end - self._hashed))
            if not b:  # shorter than when opened (truncated meanwhile): never whole
                raise OSError(f"{self.raw.name} ended at byte {self._hashed} while it was read (it changed)")
            self._h.update(b)
            self._hashed += len(b)
            if keep:
                self._kept += b
            else:
                self._kept_at = self._hashed
        if len(self._kept) > self.keep:
            self.release(self._hashed - self.keep)

    def finish(self) -> None:
        """Hash the rest of the file: `digest` is the whole file's from now on."""
        self._kept, self._kept_at = bytearray(), self._hashed
        self._advance(self.size, keep=False)
        self.whole = self.raw.read(1) == b""  # nothing appended while it was read

    def digest(self) -> str | None:
        return self._h.hexdigest() if self.whole else None

    def close(self) -> None:
        self._kept = bytearray()
        self.raw.close()
        super().close()
