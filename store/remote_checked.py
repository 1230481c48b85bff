"""What a pull already checked: a fetched file's CRC32C, size, mtime and inode, kept with the file.

A pull (and a cache's whole or lazy open, which pull through the same `fetch_checked`) checks each object's CRC32C
as it streams in; a rerun after a kill keeps the files already fetched. Without a record it had to read each of
them again to know it is intact - at 1M samples, terabytes on every resume. So the CRC32C computed while the file
arrived is recorded with it as an extended attribute (`user.qwen-edit.checked`: "crc32c nbytes mtime_ns inode"),
and a rerun trusts a file whose size, mtime_ns and inode are still those recorded (one stat and one getxattr), as
rsync's quick check and git's index do; any other file (no record, a file system without user xattrs, a size or
mtime that moved: truncated, appended, rewritten) is read again and refetched when it differs.

What is trusted, and why that is enough: bytes changed in place with the size kept and the mtime set back (a
deliberate `os.utime`, or bit rot the file system does not see) pass the resume unread. They are found where every
committed byte is checked anyway: each reader checks every sample's CRC32C before it is used (store/check_ahead.py), and `pipeline store
verify` reads every byte. The record never replaces those checks; it only spares a resume a second full read.
"""

from __future__ import annotations

import os
from pathlib import Path

CHECKED_XATTR = "user.qwen-edit.checked"


def record(path: Path, crc: str) -> None:
    """Record that `path`'s bytes, as they are now, have CRC32C `crc` (computed while they were written). A file
    system without user xattrs records nothing: a rerun then reads the file again."""
    try:
        st = os.stat(path)
        os.setxattr(path, CHECKED_XATTR, f"{crc} {st.st_size} {st.st_mtime_ns} {st.st_ino}".encode())
    except (OSError, AttributeError):  # EOPNOTSUPP (some NFS, old tmpfs), or no xattrs on this OS
        pass


def still_checked(path: Path, crc: str, nbytes: int) -> bool:
    """Does `path` carry a record of CRC32C `crc` and `nbytes` bytes, with its size, mtime and inode unchanged
    since? False (read it) on any doubt."""
    try:
        st = os.stat(path)
        value = os.getxattr(path, CHECKED_XATTR).decode().split()
    except (OSError, AttributeError, UnicodeDecodeError):
        return False
    return value == [crc, str(nbytes), str(st.st_mtime_ns), str(st.st_ino)] and st.st_size == nbytes
