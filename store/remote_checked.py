"""What a pull already checked: a local file's CRC32C, kept with the file with the size, mtime and inode it had.

A pull (and a cache's whole or lazy open, which pull through the same `fetch_checked`) checks each object's CRC32C
as it streams in; a rerun after a kill keeps the files already fetched. Without a record it had to read each of
them again to know it is intact - at 1M samples, terabytes on every resume. So the CRC32C computed while the file
arrived is recorded with it as an extended attribute (`user.qwen-edit.checked`: "crc32c nbytes mtime_ns inode"),
and a rerun trusts a file whose size, mtime_ns and inode are still those recorded (one stat and one getxattr), as
rsync's quick check and git's index do; any other file (no record, a file system without user xattrs, a size or
mtime that moved: truncated, appended, rewritten) is read again and refetched when it differs. Every open of a
cached version compares its manifest's CRC32C with the remote's record the same way (`known_crc`): ~190 MB read
per table and open at 1M samples before.

What is trusted, and why that is enough: bytes changed in place with the size kept and the mtime set back (a
deliberate `os.utime`, a same-size rewrite within the clock tick of the fetch, bit rot the file system does not
see) pass the resume unread. They are found where every committed byte is checked anyway: each reader checks every
sample's CRC32C before it is used (store/check_ahead.py), and `pipeline store verify` reads every byte. The record
never replaces those checks; it only spares a resume a second full read.
"""

from __future__ import annotations

import os
from pathlib import Path

from store.checksum import file_crc

CHECKED_XATTR = "user.qwen-edit.checked"


def _state(st: os.stat_result) -> str:
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ino}"


def _set(path: Path, value: str) -> None:
    try:
        # the bytes on disk before the record: after an OS crash (not a kill) a file system may show the full
        # size with blocks never written, and a record set first would vouch for them (cheap where pull's commit
        # fsyncs the file anyway)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.setxattr(path, CHECKED_XATTR, value.encode())
    except (OSError, AttributeError):  # EOPNOTSUPP (some NFS, old tmpfs), or no xattrs on this OS: nothing kept
        pass


def record(path: Path, crc: str) -> None:
    """Record that `path`'s bytes, as they are now, have CRC32C `crc` (computed while they were written)."""
    try:
        _set(path, f"{crc} {_state(os.stat(path))}")
    except OSError:
        pass


def known_crc(path: Path) -> tuple[str, int]:
    """(CRC32C, size) of `path`, as `store.checksum.file_crc`: the recorded value while the file's size, mtime and
    inode are those recorded with it, else read (and recorded, unless it changed during the read)."""
    st = os.stat(path)
    try:
        crc, state = os.getxattr(path, CHECKED_XATTR).decode().split(" ", 1)
        if state == _state(st):
            return crc, st.st_size
    except (OSError, AttributeError, UnicodeDecodeError, ValueError):
        pass
    crc, n = file_crc(path)
    if n == st.st_size and _state(os.stat(path)) == _state(st):
        _set(path, f"{crc} {_state(st)}")
    return crc, n
