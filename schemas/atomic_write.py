"""The one atomic-write rule of the project: a temp file beside the final one (`schemas.temp_files.temp_of`),
fsynced, renamed over it (or to a name still free: `rename_new`), then the folder fsynced, so a reader sees the
old file or the whole new one, and a file a run said it saved is still there after a power loss (its name is in
the folder's entries only once the folder is fsynced).

In schemas/ so every writer uses it: the store's (store/format.py `atomic_write_bytes`, `atomic_dir`) and the ones
that may import nothing but schemas (models/canonical_safetensors.py, models/lora_export.py, the profiler's trace).
Callers reach these through the module (`atomic_write.fsync_dir(...)`), so a test that replaces one replaces it
for every writer.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from schemas.temp_files import temp_of


def fsync_dir(path: Path) -> None:
    """fsync the folder (or file) `path`: a folder's new and renamed entries survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def named_as_final(e: BaseException, tmp: Path, final: Path) -> BaseException:
    """`e` with the user's path where it names the temp path of an atomic write (`.NAME.tmp-PID`, or a file in
    that temp folder: the same path under `final`), the temp path kept as a detail; else `e` itself. The user
    gave `final` (--out, --store, a folder to write): an error naming a hidden temp path sends them looking for a
    file that was never theirs, and is gone by the time they read the line."""
    if not isinstance(e, OSError) or e.filename is None:
        return e
    named = Path(os.fsdecode(e.filename))
    if named != tmp and tmp not in named.parents:
        return e
    mapped = final / named.relative_to(tmp)
    try:
        new = type(e)(e.errno, f"{e.strerror} (writing it as the temp path {named})", str(mapped),
                      *((None, e.filename2) if e.filename2 is not None else ()))
    except TypeError:  # an OSError subclass of another signature: left as it was
        return e
    return new


@contextmanager
def atomic_file(path: Path, replace: bool = True, sync_dir: bool = True) -> Iterator[BinaryIO]:
    """The atomic write of a file written in pieces (a manifest streamed row group by row group, never whole
    in memory): the yielded file is the temp file, renamed to `path` when the block ends without error (what the
    block does after its last write, e.g. another file that must exist first, happens before the rename)."""
    tmp = temp_of(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path) if replace else rename_new(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if (named := named_as_final(e, tmp, path)) is not e:
            raise named from e
        raise
    if sync_dir:
        fsync_dir(path.parent)


def rename_new(src: Path, dst: Path) -> None:
    """Rename `src` to `dst` in the same folder unless a file is named `dst` there: FileExistsError then, even
    where this node's cached view of a shared folder does not show that file yet - the name is taken by a hard
    link, which the file server refuses for a name it holds (NFS LINK), where a rename would replace the file."""
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError:  # no hard links on this file system: by this node's view, the best it can do
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst)) from None
        os.rename(src, dst)
        return
    os.unlink(src)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """`atomic_file` for a writer that takes a file name, not an open file (a library's `export(name)`): the
    yielded path is the temp path; when the block ends without error the file is fsynced, renamed to `path`, and
    its folder fsynced. On error the temp file is removed."""
    tmp = temp_of(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if (named := named_as_final(e, tmp, path)) is not e:
            raise named from e
        raise
    fsync_dir(path.parent)
