"""The object-store guarantees on a `file://` remote (a local or shared file system), which fsspec's
LocalFileSystem does not give: its `put_file` / `pipe_file` write in place, so a killed push leaves a torn object
under its final name (a rerun then finds "the same name, another size" and stops: the stores grew apart), and it
has no conditional write, so "write once" and compare-and-swap would be a check then a write.

Here, as on S3: an object appears whole or not at all (written to a temp file under `.uploads/`, then renamed or
hard-linked into place; a kill leaves only the temp file, which `store gc` removes), a write-once object is
created with `link(2)`, which fails when the name exists (an atomic "If-None-Match: *"), and a compare-and-swap
holds a flock (`.locks/`, the mechanism the local store uses, dropped by the kernel when the process dies).
"""

from __future__ import annotations

import os
import secrets
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from store import format as fmt
from store.checksum import CHUNK, RunningCrc
from store.remote_upload import check

UPLOAD_DIR = ".uploads"  # temp files of objects being written; a killed writer's are removed by `store gc`
CRC_XATTR = "user.crc32c"  # an object's CRC32C, recorded when it is created (a file's bytes never change after)
LOCK_DIR = ".locks"  # one flock per object updated by compare-and-swap (store.json, quarantine.parquet)


def protocols(fs: Any) -> tuple[str, ...]:
    """The fsspec file system's protocol names (its `protocol` is one string or several)."""
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def is_local(fs: Any) -> bool:
    return bool({"file", "local"} & set(protocols(fs)))


def _temp(root: str) -> Path:
    folder = Path(root) / UPLOAD_DIR
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}"


def _written(tmp: Path, chunks: Iterator[bytes], progress=None) -> tuple[int, str]:
    """(bytes written, their CRC32C)."""
    crc, n = RunningCrc(), 0
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            crc.update(chunk)
            n += len(chunk)
            fmt.crash_point("remote_local_mid_write")
            if progress is not None:
                progress.update(len(chunk))
        f.flush()
        os.fsync(f.fileno())  # whole on disk before its name says so
    return n, crc.hex()


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


def write(root: str, path: str, data: bytes) -> None:
    """Write (or replace) the object at `path` atomically: readers see the old bytes or the new, never part."""
    tmp = _temp(root)
    try:
        _written(tmp, iter([data]))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def create(root: str, local: Path, path: str, progress, crc: str | None = None,
           expect: tuple[int, str] | None = None) -> bool:
    """Copy `local` to `path` only if no object `path` exists (False then, nothing written): `link(2)` fails on an
    existing name, so of two writers exactly one creates it, and the object is whole from its first instant.
    `crc` (its CRC32C) is recorded with it (`recorded_crc`), as push records it in an S3 object's metadata.
    `expect` (nbytes, crc): the bytes copied must be those (one read of `local`), else `Mismatch`, nothing linked."""
    if os.path.lexists(path):  # spares the copy; the link below decides
        return False
    tmp = _temp(root)
    try:
        check(*_written(tmp, _file_chunks(local), progress), expect)
        if crc is not None:
            _record_crc(tmp, crc)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(tmp, path)
        except FileExistsError:
            # NFS retries a link whose reply was lost and reports the name taken - by this very link: then the
            # temp file has a second name (the classic NFS-safe lock test)
            return os.stat(tmp).st_nlink == 2
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _record_crc(path: Path, crc: str) -> None:
    """The CRC32C as an extended attribute of the (not yet linked) object: a resumed push then knows an object is
    already there from one getxattr, where reading it back cost its whole size (terabytes for a large store). A
    file system without user xattrs records nothing (then the bytes are read)."""
    try:
        os.setxattr(path, CRC_XATTR, crc.encode())
    except (OSError, AttributeError):  # EOPNOTSUPP (some NFS, tmpfs on old kernels), or no xattrs on this OS
        pass


def recorded_crc(path: str) -> str | None:
    """The CRC32C `create` recorded with the object, None when none was (then its bytes tell)."""
    try:
        return os.getxattr(path, CRC_XATTR).decode()
    except (OSError, AttributeError, UnicodeDecodeError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        return None


def find(folder: str, prefix: str) -> dict[str, dict]:
    """fsspec's `find(folder, detail=True)` of the files whose path below `folder` starts with `prefix`: the
    folder's names are read and only the matching ones stat'ed (LocalFileSystem's find stats every entry, and a
    version's folder holds ~40k at 1M samples, on a shared file system a round trip each)."""
    sub, _, start = prefix.rpartition("/")
    top = os.path.join(folder, sub) if sub else folder
    found: dict[str, dict] = {}

    def add(path: str) -> None:
        try:
            st = os.stat(path)
        except FileNotFoundError:  # removed meanwhile
            return
        found[path] = {"name": path, "size": st.st_size, "type": "file", "mtime": st.st_mtime}

    with os.scandir(top) as entries:  # FileNotFoundError: nothing there (the caller's)
        for entry in entries:
            if not entry.name.startswith(start):
                continue
            if entry.is_dir(follow_symlinks=False):
                for base, _, names in os.walk(entry.path):
                    for name in names:
                        add(os.path.join(base, name))
            else:
                add(entry.path)
    return found


@contextmanager
def exclusive(root: str, rel: str) -> Iterator[None]:
    """Held around a read-modify-write of the object `rel`, so that two writers never drop each other's update."""
    folder = Path(root) / LOCK_DIR
    folder.mkdir(parents=True, exist_ok=True)
    with fmt.flock(folder / (rel.replace("/", "%") + ".lock")):
        yield
