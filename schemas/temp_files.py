"""The names of atomic writes' temp files and folders (`.<name>.tmp-<pid>-h<host>[-n<pid namespace>]`), and whose
writer is gone.

A rule of names shared by every atomic write (schemas/atomic_write.py; store/format.py `atomic_dir`) and the
model-side writers that may import nothing but schemas (models/lora_export.py): one rule for "a killed writer's
leftover, safe to remove", so no writer removes what a live one is still writing.

The name says whose process wrote it: the pid, the host (a hash of `schemas.host.host_id`, the running kernel's
boot id) and the pid namespace (the container: pods of one node share the kernel and number their processes
apart), as the URL cache names its fetches (store/lease.py `process_tag`). Only a temp of this host and namespace
is judged by its pid: another host's or container's (a run folder or store on NFS, a volume shared by pods) pid 123
is not this one's pid 123, and a live writer's temp was taken for a dead one and removed. Names of earlier releases
(`.<name>.tmp-<pid>`) are judged by their pid, as they were.

A temp name must fit the file system's limit on one name (`NAME_MAX`, 255 bytes) where its final name does: the
writer's tag adds up to ~40 bytes, and a user's 250-byte `--out` failed with "File name too long" at its final
write, after the work. A name too long for that keeps its first bytes and stands in a hash of the whole for the
rest (`temp_stem`): `.<first bytes>~<hash>.tmp-<writer>`, a pure function of the final name, so every reader
finds both forms (`temps_of`)."""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import time
from functools import lru_cache
from pathlib import Path

from schemas.errors import UserError
from schemas.host import host_id, pid_namespace_id

# Another host's or namespace's temp is removed only once nothing in it changed for this long. Its writer cannot
# be asked from here and keeps no heartbeat; a live one touches its temp as it writes, but may sit between two
# writes (a checkpoint's optimizer state, a merge's next shard) or be paused (SIGSTOP, a suspended VM, a hung
# mount). A day is past any such pause, and keeping a dead writer's temp that long only holds disk: its own host
# removes it sooner (by its pid) at that host's next write of the same name - unless it rebooted since (a new boot
# id: its temps of before are another host's then, kept a day; `store verify` names them so).
ABANDONED_S = 24 * 3600
_TAG = re.compile(r"(\d+)-h([0-9a-f]{12})(?:-n(\d+))?")
NAME_MAX = 255  # bytes in one file name: ext4, xfs, btrfs, tmpfs, NFS; a longer one is ENAMETOOLONG
# Room kept after a temp's stem for the longest suffix put after it: `.tmp-<pid>-h<host>-n<namespace>` (38 bytes
# at Linux's largest pid and namespace inode), atomic_dir's `.swapped-<pid>` (16), with bytes to spare
SUFFIX_ROOM = 48
_HASH = 16  # hex digits of sha256 standing in for the cut end of a long name


def name_bytes(name: str) -> int:
    """Bytes of `name` on disk (a name read from disk that is not UTF-8 holds its bytes as surrogates)."""
    return len(name.encode("utf-8", "surrogateescape"))


def temp_stem(name: str) -> str:
    """The start of the names of temp files (and other siblings: `.swapped-`) of the final name `name`: `.NAME`,
    or - where that and a suffix of `SUFFIX_ROOM` bytes would pass `NAME_MAX` - `.` + NAME's first bytes (whole
    characters) + `~` + a hash of the whole name."""
    if 1 + name_bytes(name) + SUFFIX_ROOM <= NAME_MAX:
        return f".{name}"
    room, head, used = NAME_MAX - SUFFIX_ROOM - 2 - _HASH, [], 0
    for ch in name:
        n = name_bytes(ch)
        if used + n > room:
            break
        head.append(ch)
        used += n
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:_HASH]
    return f".{''.join(head)}~{digest}"


def siblings(final: Path, suffix: str) -> list[Path]:
    """The files and folders beside `final` named `<stem><suffix><anything>`, in either form of its stem
    (`temp_stem`, and `.NAME` as earlier releases named them for every name)."""
    final = Path(final)
    stems = dict.fromkeys([f".{final.name}", temp_stem(final.name)])
    return [p for stem in stems for p in final.parent.glob(f"{glob.escape(stem)}{glob.escape(suffix)}*")]


def check_name_fits(path: Path, what: str) -> None:
    """A final name the user gave (`--out`) longer than `NAME_MAX`: one line now, not "File name too long" after
    the work."""
    if (n := name_bytes(Path(path).name)) > NAME_MAX:
        raise UserError(f"{what} {path}: its name is {n} bytes, over the {NAME_MAX} bytes a file system allows in "
                        "one name; choose a shorter name")


@lru_cache(maxsize=1)
def _here() -> tuple[str, str | None]:
    """(host, pid namespace) of this process as its temp names write them; the namespace None without /proc."""
    host = hashlib.sha256(host_id().encode()).hexdigest()[:12]
    ns = pid_namespace_id()
    return host, None if ns is None else str(ns)


def temp_of(final: Path) -> Path:
    """This process's temp name for `final`: beside it (the rename stays on one file system), hidden, named by its
    writer (pid, host, pid namespace); within `NAME_MAX` whenever `final`'s name is (`temp_stem`)."""
    host, ns = _here()
    tag = f"{os.getpid()}-h{host}" + (f"-n{ns}" if ns is not None else "")
    return final.with_name(f"{temp_stem(final.name)}.tmp-{tag}")


def writer_alive(temp: Path) -> bool:
    """Is the writer of the temp file / folder `temp` (`temp_of`'s name) still writing it? This host's and pid
    namespace's (or an earlier release's name, `.<name>.tmp-<pid>`): while its pid is a live process here (a pid
    not ours to signal counts as alive). Another host's or namespace's: until nothing in it changed for
    `ABANDONED_S`. A name without a pid counts as gone (its writer is not known)."""
    temp = Path(temp)
    tail = temp.name.rsplit(".tmp-", 1)[-1]
    if tail.isdigit():
        return _pid_alive(int(tail))
    m = _TAG.fullmatch(tail)
    if m is None:
        return False
    pid, host, ns = m.groups()
    if (host, ns) == _here():
        return _pid_alive(int(pid))
    return not _untouched_for(temp, ABANDONED_S)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _untouched_for(temp: Path, seconds: float) -> bool:
    """Nothing in `temp` (the file, or the folder and all it holds) modified for `seconds`; False when it is gone
    meanwhile (renamed in by its writer: nothing to remove)."""
    since = time.time() - seconds
    try:
        if os.lstat(temp).st_mtime > since:
            return False
        if temp.is_dir() and not temp.is_symlink():
            for folder, dirs, files in os.walk(temp):
                for name in (*dirs, *files):
                    if os.lstat(os.path.join(folder, name)).st_mtime > since:
                        return False
    except FileNotFoundError:
        return False
    return True


def remove_dead_temps(final: Path, own: Path | None = None) -> None:
    """Remove the temp files and folders of `final` whose writer is gone: a killed writer's, which nothing else
    ever removes (a LoRA export's hundreds of MB beside the user's file). Never `own`, never a live writer's."""
    for left in siblings(final, ".tmp-"):
        if left == own or writer_alive(left):
            continue
        if left.is_dir() and not left.is_symlink():
            shutil.rmtree(left, ignore_errors=True)
        else:
            left.unlink(missing_ok=True)
