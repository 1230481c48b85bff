"""A full disk or a read-only folder while writing: one clear line (what, where, how much space is free and, when
known, needed) instead of a traceback. Callers remove their temp files; committed data is never touched, so the
rerun after freeing space resumes and completes."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from schemas.errors import UserError
from schemas.units import size_text

_FULL = (errno.ENOSPC, errno.EDQUOT)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


# a store URL's cache fills its disk again on a rerun unless it is limited (store/remote_cache.py)
CACHE_FULL = ("or limit the cache below its disk's free space with --cache-gb G: the shards that do not fit are then "
              "read by byte range")


class DiskFullError(UserError):
    """No space left while writing (ENOSPC / EDQUOT)."""


def is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in _FULL:
        return True
    text = str(e)  # safetensors (Rust) raises SafetensorError("... No space left on device (os error 28)")
    return "os error 28" in text or "No space left on device" in text


def is_file_too_large(e: BaseException) -> bool:
    """EFBIG: a file grew past the file-size limit (`ulimit -f`, RLIMIT_FSIZE) or its file system's largest file
    (FAT32: 4 GiB). Not a full disk: freeing space does not help."""
    if isinstance(e, OSError) and e.errno == errno.EFBIG:
        return True
    return "(os error 27)" in str(e)  # safetensors (Rust): "File too large (os error 27)"


def is_not_writable(e: BaseException) -> bool:
    if isinstance(e, PermissionError) or (isinstance(e, OSError) and e.errno in _READ_ONLY):
        return True
    text = str(e)  # safetensors (Rust): SafetensorError("... Permission denied (os error 13) at path ...")
    return any(f"(os error {n})" in text for n in _READ_ONLY)


def _free(where: Path) -> str:
    p = Path(where)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return f"{size_text(shutil.disk_usage(p).free)} free"
    except OSError:
        return "free space unknown"


def describe(e: BaseException, what: str, where: Path, need: int | None = None, instead: str = "") -> UserError | None:
    """The one-line error for a disk-full / not-writable failure, else None. `instead`: what else helps with a full
    disk than freeing space (a rerun alone meets the same full disk at the same point)."""
    if is_disk_full(e):
        needed = f", about {size_text(need)} needed" if need else ""
        return DiskFullError(f"disk full while writing {what} in {where} ({_free(where)}{needed}); free space"
                             f"{f' ({instead})' if instead else ''} and rerun: what was already committed is kept, "
                             "the partial write was removed")
    if is_file_too_large(e):
        return DiskFullError(f"file too large while writing {what} in {where}: it passed the largest file allowed "
                             f"here (the process's file-size limit, `ulimit -f`, or the file system's, e.g. FAT32's "
                             f"4 GiB); raise the limit or write to another file system and rerun: what was already "
                             f"committed is kept, the partial write was removed")
    if is_not_writable(e):
        name = getattr(e, "filename", None) or where
        return UserError(f"cannot write {what}: {name} is not writable ({getattr(e, 'strerror', None) or e}); "
                         "check the folder's permissions or choose another location")
    return None


@contextmanager
def writing(what: str, where: Path, need: int | None = None, instead: str = "") -> Iterator[None]:
    """Turn a full disk / read-only folder inside the block into one clear UserError."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # anything that is not a full disk / read-only folder is re-raised unchanged
        err = describe(e, what, where, need, instead)
        if err is None:
            raise
        raise err from None


def check_writable(folder: Path, what: str) -> None:
    """Create `folder` and a probe file in it (removed at once) before minutes of work whose result is written
    there (predict's image, a merged model): a read-only or full folder is one line naming it now, not after the
    work, its result lost."""
    folder = Path(folder)
    # the host too: the ranks of a launch across nodes probe one shared folder, and two nodes' pids may be alike;
    # the thread: one process's threads probe apart. Not O_EXCL: a probe a killed process of a pid now reused
    # left is this one's to overwrite (it failed with EEXIST, a traceback)
    probe = folder / f".write-probe-{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        os.unlink(probe)
    except OSError as e:
        err = describe(OSError(e.errno, e.strerror, str(folder)), what, folder)
        if err is None:
            raise
        raise err from None
