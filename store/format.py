"""The on-disk layout of a store (see docs/store-format.md): names, `store.json`, atomic writes (by the rule of
schemas/atomic_write.py), locks.

The format name and version are defined here once and checked on every open.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import signal
import socket
import stat
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.errors import UserError
from schemas.file_digest import file_sha256
from schemas import atomic_write, interruptible
from schemas.newer import refuse_newer
from schemas.temp_files import remove_dead_temps, siblings, temp_of, temp_stem


# pyarrow imports pandas (where installed) at its first conversion of a Python value - `pc.equal(column, "train")`,
# `pa.array(rows)`, `pa.scalar(x)`, even of a numpy array - inside that call, to ask whether the value is a pandas
# one, and pyarrow.compute reports any error of it as "TypeError: Got unexpected argument type <class 'str'>". A
# Ctrl-C landing in that import (0.4-0.6 s on 2 cores; pandas' Cython modules make a SystemError of the
# KeyboardInterrupt) ended a training's start on "stopped by SIGINT (TypeError while stopping)", from `split_rows`.
# Nothing here hands pyarrow a pandas value, so its first check is answered "no pandas" (an import that fails at
# once, as on an install without pandas): no import for a signal to land in, and none of its 0.4-0.6 s at the start
# of every command that reads a store. pyarrow's own pandas calls (`to_pandas`) still import it when asked.
class _NoPandas:
    """An import finder that answers `import pandas` with ImportError, as an install without pandas does (a None in
    sys.modules does not: pyarrow's Cython import takes the None for the module) - in the thread that installed it
    only: another thread importing pandas meanwhile gets it (before, an ImportError). pyarrow has no knob for this
    (its pandas-shim tries `import pandas` once, in private state)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()

    def find_spec(self, name, path=None, target=None):
        if name == "pandas" and threading.get_ident() == self.thread:
            raise ImportError("pandas: left to pyarrow's own pandas calls")
        return None


def _arrow_without_pandas() -> None:
    """Have pyarrow's first pandas check (pandas-shim's `_have_pandas_internal`, once per process) find none."""
    if "pandas" in sys.modules:  # imported already (xarray's): pyarrow's check costs nothing, nothing can land in it
        return
    finder = _NoPandas()
    # a new list, never the one changed in place: an import in another thread iterates the list it took, and a
    # removal under its loop shifted the next finder past it (that import then missed its finder)
    sys.meta_path = [finder, *sys.meta_path]
    try:
        pa.array([0])
    finally:
        sys.meta_path = [f for f in sys.meta_path if f is not finder]


_arrow_without_pandas()

STORE_FORMAT = "qwen-edit-feature-store"
# 2: store.json sealed with its own CRC32C, each version's `checksums.json`, per-sample `sample_crc32c` (see
# docs/store-format.md). Version 1 stores (and v1-era table versions inside a v2 store) stay readable: their
# samples are checked against the sha256 the manifest always held.
STORE_FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)

STORE_JSON = "store.json"
STORE_LOCK = ".store.lock"
QUARANTINE = "quarantine.parquet"
SCHEMA_JSON = "schema.json"
MANIFEST = "manifest.parquet"
CHECKSUMS = "checksums.json"  # per version: size + crc32c of every file; written just before the manifest
VERSION_RE = re.compile(r"v(\d+)")
SHARD_RE = re.compile(r"shard-r(\d+)-(\d+)\.tar")
KEY_RE = re.compile(r"[A-Za-z0-9_-]+")  # webdataset splits member names at the first dot: keys have none


def version_dir(root: Path, table: str, version: int) -> Path:
    return root / table / f"v{version}"


def shard_prefix(rank: int) -> str:
    """How every shard (and shard index) name of `rank` starts: the dash ends the number, so rank 1's is not a
    prefix of rank 10's (`shard-r10-`), nor rank 10's of rank 100's."""
    return f"shard-r{rank:02d}-"


def shard_name(rank: int, index: int) -> str:
    return f"{shard_prefix(rank)}{index:06d}.tar"


def index_name(shard: str) -> str:
    """Per-shard index sidecar; its presence means the shard is committed."""
    return shard[: -len(".tar")] + ".index.parquet"


def shard_of(name: str) -> str | None:
    """The shard a file of a version belongs to: a shard's own name, or the shard an index describes; None for
    every other file."""
    tar = name[: -len(".index.parquet")] + ".tar" if name.endswith(".index.parquet") else name
    return tar if SHARD_RE.fullmatch(tar) else None


def rank_done_name(rank: int) -> str:
    return f"rank-{rank:02d}.done"


def version_id(version: int, manifest: bytes | memoryview | Path | io.BufferedReader) -> str:
    """`v<N>-<sha256 of its manifest>`, the name of one immutable version (`Store.version_id`). A path (or an open
    file) is hashed as it is read, never held whole: a manifest is ~140 MB at 1M samples, read by evaluate for each
    table."""
    if isinstance(manifest, (Path, io.BufferedReader)):
        return f"v{version}-{file_sha256(manifest)[:16]}"
    return f"v{version}-{hashlib.sha256(manifest).hexdigest()[:16]}"


def file_identity(st: os.stat_result) -> tuple[int, int, int] | None:
    """Which manifest file a complete version's is: (inode, mtime ns, size); None for no regular file. A stat, not
    a hash (a manifest is ~140 MB at 1M samples): a version is immutable, and a new one of the same number (after
    gc) is written as a new file (`atomic_write_bytes`), so a reused inode would need the same mtime and size. The
    read leases (store/lease.py) tell versions apart by it, without the ctime (a `chmod -R` of the store would make
    live leases look lost); `Store.version_id`'s cache adds the ctime."""
    return (st.st_ino, st.st_mtime_ns, st.st_size) if stat.S_ISREG(st.st_mode) else None


def list_versions(root: Path, table: str) -> list[int]:
    d = root / table
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if p.is_dir() and (m := VERSION_RE.fullmatch(p.name)))


def is_complete(vdir: Path) -> bool:
    return (vdir / MANIFEST).is_file()


def damaged_marker(root: Path, table: str, version: int) -> Path:
    """Written by `pipeline store repair` next to (not inside: versions are immutable) a damaged version: its
    damaged keys. `Store.find_version` never reuses a marked version, so the stage rerun recomputes them."""
    return root / table / f"v{version}.damaged.json"


# `v<N>.damaged/`: a damaged version `store repair` (or a stage's rerun) replaced and set aside; not a version name,
# so every reader and writer ignores it; `store gc` removes it (store/gc.py)
SET_ASIDE_SUFFIX = ".damaged"
SET_ASIDE_RE = re.compile(r"v(\d+)\.damaged")


def set_aside_versions(root: Path, table: str) -> list[tuple[int, Path]]:
    """(N, folder) of each `v<N>.damaged/` of the table, by N."""
    d = root / table
    if not d.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in d.iterdir() if p.is_dir() and (m := SET_ASIDE_RE.fullmatch(p.name)))


# `store repair`'s working folder for the shards of v<N> it carries as their recorded bytes (store/repair.py
# `_carry_trimmed`): a dot folder, so no version; `store gc` removes one a killed repair left
TRIM_RE = re.compile(r"\.trim-v(\d+)")


def trim_dir(root: Path, table: str, version: int) -> Path:
    return root / table / f".trim-v{version}"


def unchanged_marker(root: Path, table: str, version: int) -> Path:
    """Written next to a version (store/reuse.py `unchanged_by_fixes`) once a scan found none of its samples
    changed by the fixes made since it was stored: a rerun trusts it instead of reading every row again."""
    return root / table / f"v{version}.unchanged.json"


def is_litter(name: str) -> bool:
    """Temp files of interrupted atomic writes (`.<name>.tmp-<writer>`, `schemas.temp_files`; `<shard>.tar.tmp`):
    never data."""
    return (name.startswith(".") and ".tmp-" in name) or name.endswith(".tar.tmp")


def store_litter(root: Path, tables) -> list[Path]:
    """Temp files of interrupted atomic writes beside the versions: in the store (store.json's) and in each of
    `tables`' folders (`v<N>.damaged.json`'s, `v<N>.unchanged.json`'s, `v<N>.note-*.json`'s)."""
    return [p for folder in (root, *(root / t for t in sorted(tables))) if folder.is_dir()
            for p in sorted(folder.iterdir()) if p.is_file() and is_litter(p.name)]


# ---------------------------------------------------------------- atomic writes


def umask_file_mode() -> int:
    """The mode `open` gives a new file under this process's umask (0o644 under 022), read from /proc (Linux)
    where os.umask would have to set it to read it, racing the threads creating files; 0o644 elsewhere."""
    try:
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        return 0o644
    return 0o666 & ~umask


def widen_private_file(path: Path) -> None:
    """safetensors writes its files 0600 (a temp file renamed): give such a file the mode `open` would have, so a
    LoRA or a merged model's weights are readable as the umask says (the group, another user's ComfyUI). A hard
    link is left alone: its mode is its source's too (a merged model's linked components)."""
    st = os.stat(path)
    if st.st_nlink == 1 and stat.S_IMODE(st.st_mode) == 0o600 and (mode := umask_file_mode()) != 0o600:
        try:
            os.chmod(path, mode)
        except OSError:  # a file system without modes (some FUSE / SMB mounts): the file is whole, keep it so
            pass


def atomic_write_bytes(path: Path, data: bytes, replace: bool = True, sync_dir: bool = True) -> None:
    """Temp file in the same folder, fsync, rename, fsync the folder: readers see the old or the new file.
    A failed write (full disk, ...) removes its temp file and re-raises. `replace=False`: a file already named
    `path` is never replaced (`rename_new`: FileExistsError). `sync_dir=False`: the folder not fsynced here - the
    caller fsyncs it once after many such files, before anything that counts on their names surviving a power
    loss (the file's bytes are durable before its name: a name that survives always has its bytes)."""
    with atomic_write.atomic_file(path, replace, sync_dir) as f:
        f.write(data)


_SWAPPED, _DELETING = ".swapped-", ".deleting-"  # `atomic_dir`'s old folder: whole, then being removed


def settle_swap(final: Path) -> None:
    """Finish what a swap of `final` (`atomic_dir`) killed midway left: with no `final`, the old folder it renamed
    aside (`.NAME.swapped-PID`, whole: the last commit) is renamed back; an old folder the swap got past (a
    `.swapped-` one beside `final`, a half-removed `.deleting-` one) is removed. For `final`'s one writer (its
    callers hold a lock on it), before it reads or writes `final`."""
    final = Path(final)
    if not final.exists():
        for old in sorted(siblings(final, _SWAPPED))[:1]:
            os.rename(old, final)
            atomic_write.fsync_dir(final.parent)
    for left in [*siblings(final, _SWAPPED), *siblings(final, _DELETING)]:
        shutil.rmtree(left, ignore_errors=True)


@contextmanager
def atomic_dir(final: Path, tmp: Path | None = None) -> Iterator[Path]:
    """Yield a fresh temp folder beside `final`; when the block ends without error, fsync everything in it and
    rename it to `final` (an existing `final` is renamed aside, the new one renamed in, then the old one removed:
    a kill during that removal leaves the new folder in place, and the next swap of `final` removes the rest; a
    kill between the two renames leaves no `final`, and the next swap, or `settle_swap`, renames the old one back),
    so a reader sees the old folder or the complete new one, never a half-written one. On error the temp folder is
    removed.

    The one folder-level commit of the project: checkpoints, the final LoRA, merged models, demo data. `tmp`
    names the temp folder when other processes must find it (checkpoint RNG files of every rank)."""
    final = Path(final)
    if tmp is None:  # the pid-named temp folder: a killed writer's (another pid, gone) is removed too
        tmp = temp_of(final)
        remove_dead_temps(final, own=tmp)
    tmp = Path(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    settle_swap(final)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:  # e.g. a file on the path: named as the user's folder (`named_as_final`)
        raise atomic_write.named_as_final(e, tmp, final) from None
    old = None
    try:
        yield tmp
        for folder, _, names in os.walk(tmp):  # walked, not listed whole: a million files are no list in memory
            for f in (Path(folder, name) for name in names):
                if f.is_file():
                    widen_private_file(f)  # safetensors' 0600 (a LoRA, checkpoint, merged weights)
                    atomic_write.fsync_dir(f)  # os.fsync works on a file descriptor of a file or a folder alike
            # its entries (a subfolder's files are not durable through the top's fsync)
            atomic_write.fsync_dir(Path(folder))
        if final.exists():
            old = final.with_name(f"{temp_stem(final.name)}{_SWAPPED}{os.getpid()}")
            os.rename(final, old)
            crash_point("atomic_dir_between_renames")
        os.rename(tmp, final)  # the new folder in place before the old one's (maybe long) removal
        atomic_write.fsync_dir(final.parent)
        if old is not None:  # renamed again before its removal: a `.swapped-` folder is always whole (`settle_swap`)
            deleting = final.with_name(f"{temp_stem(final.name)}{_DELETING}{os.getpid()}")
            os.rename(old, deleting)
            old = deleting
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not final.exists():  # failed between the two renames: the old folder back
            os.rename(old, final)
        if (named := atomic_write.named_as_final(e, tmp, final)) is not e:
            raise named from e
        raise
    if old is not None:
        crash_point("atomic_dir_removing_old")
        shutil.rmtree(old)


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link a file (or every file of a folder) to dst: same bytes, no copy of multi-GB weights or shards;
    the source stays intact. Symlinks (hub snapshots point into a blob cache) are followed to the real file.
    Falls back to a copy across file systems or where hard links are not supported: a copy's bytes are its own,
    fsynced here, so a caller that makes only the name durable (a folder fsync: a carried shard, a migrated
    version) never keeps a named file whose bytes a power loss dropped."""
    if src.is_dir():
        dst.mkdir(parents=True, exist_ok=True)
        for child in src.iterdir():
            link_or_copy(child, dst / child.name)
        return
    real = src.resolve()
    try:
        os.link(real, dst)
    except OSError:
        shutil.copy2(real, dst)
        with open(dst, "rb") as f:  # read-only: the copy keeps its source's mode (fsync needs no write access)
            os.fsync(f.fileno())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


# Rows per parquet row group of every file the store writes (manifests, shard indexes, quarantine.parquet): a
# manifest read a few rows or a column at a time (`ManifestView.rows_at`, `store verify`) decodes the row groups
# holding those rows, never more than one group of a column at once. pyarrow's default writes up to 1M rows as one
# group (a ~100 MB column decoded whole at 1M samples). Readers take any grouping: a manifest written before, in
# one group, reads as it did (its bytes, hence its `version_id`, unchanged).
ROW_GROUP_ROWS = 65_536


def parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=ROW_GROUP_ROWS)
    return buf.getvalue()


def atomic_write_parquet(path: Path, table: pa.Table, replace: bool = True, sync_dir: bool = True) -> None:
    atomic_write_bytes(path, parquet_bytes(table), replace, sync_dir)


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{what} is not valid JSON: {path} ({e})") from None


# ---------------------------------------------------------------- store.json


# A table's entry in store.json: {"current": N}, and "was_current": [numbers past N that were current once] when a
# version was switched back to an older one (a rerun of older settings adopting their version: `Store.set_current`,
# a URL's `make_current`). gc tells the two kinds of complete version past the current one apart by it: one never
# current is a commit whose store.json switch failed, which its rerun adopts (kept), one in this list was switched
# away from (removed, as every replaced version). Only numbers past the current one are listed: any version below it
# is replaced already. gc takes a number out before it removes that version (a later version of that number is
# another one), and so does a switch that makes it current again or passes it.
WAS_CURRENT = "was_current"


def was_current(entry: dict[str, Any] | None) -> set[int]:
    """The versions past a table's current one that were current once (its store.json entry's `was_current`)."""
    return {int(v) for v in (entry or {}).get(WAS_CURRENT) or ()}


def table_entry(old: dict[str, Any] | None, version: int, forget: set[int] = frozenset(),
                also: set[int] = frozenset()) -> dict[str, Any]:
    """A table's store.json entry with `version` current, after `old` (None: the table is new): the current one it
    replaces joins `was_current` when it is past `version` (a switch back), as do the numbers in `also` (a push's
    copies of versions its store switched away from), and numbers not past `version` (or in `forget`: gc removes
    those versions) leave it."""
    was = was_current(old) | ({int(old["current"])} if old is not None else set()) | set(also)
    was = sorted(v for v in was if v > version and v not in forget)
    return {"current": version, **({WAS_CURRENT: was} if was else {})}


def forget_was_current(tables: dict[str, Any], drop) -> dict[str, Any] | None:
    """store.json's `tables` with each (table, number) in `was_current` that `drop(table, number)` names taken out
    (gc removes those versions: a later version of that number is another one); None when nothing is."""
    out = dict(tables)
    for table, entry in tables.items():
        if forget := {v for v in was_current(entry) if drop(table, v)}:
            out[table] = table_entry(entry, int(entry["current"]), forget)
    return None if out == tables else out


def new_store_record() -> dict[str, Any]:
    return {"format": STORE_FORMAT, "format_version": STORE_FORMAT_VERSION, "tables": {}}


def write_store_record(root: Path, rec: dict[str, Any]) -> None:
    """store.json, sealed with its own checksum; always written in the current format version (older table
    versions in the store stay readable, see READABLE_FORMAT_VERSIONS)."""
    from store.checksum import seal

    atomic_write_bytes(root / STORE_JSON, seal({**rec, "format_version": STORE_FORMAT_VERSION}))


def read_store_record(root: Path) -> dict[str, Any]:
    from store.checksum import SealError, is_sealed, unseal

    path = root / STORE_JSON
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"store.json not found: {path}") from None
    if is_sealed(data):
        try:
            rec = unseal(data)
        except SealError as e:
            raise UserError(f"{path} is damaged: {e}; run `pipeline store repair {root}`") from None
    else:  # format 1 wrote no checksum; every later format seals, so an unsealed record claiming one is damaged
        try:
            rec = read_json(path, "store.json")
        except UserError as e:  # not JSON: damaged as a record whose seal fails, and rebuilt the same way
            raise UserError(f"{e}; it is damaged: run `pipeline store repair {root}`") from None
        if isinstance(rec, dict) and rec.get("format") == STORE_FORMAT and rec.get("format_version") != 1:
            raise UserError(f"{path} has no checksum, which only format version 1 lacks; it is damaged: "
                            f"run `pipeline store repair {root}`")
    check_store_record(rec, path, sealed=is_sealed(data))
    return rec


def check_store_record(rec: Any, path: Path | str, sealed: bool = True) -> None:
    """`path`: the record's file, or its URL as a string (a Path would merge the `//` of `s3://`). `sealed`: its
    seal held (a later format version is then a newer release's store: `WrittenByNewer`, never repaired)."""
    found = (rec.get("format"), rec.get("format_version")) if isinstance(rec, dict) else (None, None)
    if found[0] == STORE_FORMAT:
        refuse_newer(str(path), rec, STORE_FORMAT_VERSION, intact=sealed, key="format_version")
    if found[0] != STORE_FORMAT or found[1] not in READABLE_FORMAT_VERSIONS:
        raise UserError(
            f"{path}: expected store format {STORE_FORMAT!r} version {' or '.join(map(str, READABLE_FORMAT_VERSIONS))}, "
            f"found {found[0]!r} version {found[1]!r}; use a pipeline release that writes this format"
        )
    tables = rec.get("tables")
    bad = not isinstance(tables, dict) or any(
        not isinstance(t, dict) or not _is_int(t.get("current"))
        or not (isinstance(t.get(WAS_CURRENT, []), list) and all(_is_int(v) for v in t.get(WAS_CURRENT, [])))
        for t in tables.values())
    if bad:
        folder = path.parent if isinstance(path, Path) else path.rsplit("/", 1)[0]
        raise UserError(f"{path}: 'tables' must map each table to {{'current': N}} (and '{WAS_CURRENT}': [N, ...]); "
                        f"the file is damaged: run `pipeline store repair {folder}`")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------- locks


@contextmanager
def flock(path: Path, *, blocking: bool = True, holder: str = "", changes_store: bool = False) -> Iterator[None]:
    """An advisory lock the kernel drops when the process dies (SIGKILL leaves no stale lock). A holder may unlink
    its lock file as it lets go (stages/train/guard.RunDirLock): a lock taken on a file no longer at `path`
    excludes nobody, so the file is opened again. A blocking one waits in short tries (`interruptible.flock`: a
    Ctrl-C another thread took held it until the other process let go, a shard another rank fetches whole: minutes).
    `changes_store`: the store's lock taken by a command that changes the store (gc), said as such where
    the store is read-only (readers that go on without a lease catch the OSError instead)."""
    while True:
        fd = _open_lock(Path(path), changes_store)
        try:
            if blocking:
                interruptible.flock(fd)
            else:
                _take_now(fd)
        except BaseException as e:
            os.close(fd)
            if not isinstance(e, BlockingIOError):
                raise
            try:
                other = Path(path).read_text().strip() or "another process"
            except FileNotFoundError:  # unlinked by its holder as it lets go: open it again
                continue
            raise UserError(_held_line(path, holder, other)) from None
        if _names(path, fd):
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())  # for the message a second writer gets
        yield
    finally:
        os.close(fd)


# a probe (`lock_holder`) holds a lock for one look: microseconds, a lock request's round trip on NFS
PROBE_PAUSES_S = (0.001, 0.004, 0.015, 0.03)


def _take_now(fd: int) -> None:
    """The lock taken without waiting for a holder (BlockingIOError while one holds it), tried again over
    `PROBE_PAUSES_S` (~50 ms) first: a probe's shared lock held for its look (gc's look for live writers, an
    encode's early check, the look for a live repair) is no holder, and refused a writer taking its lock right
    then, naming the lock's last holder (long gone)."""
    for pause in PROBE_PAUSES_S:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(pause)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _held_line(path: Path, holder: str, other: str) -> str:
    return f"{holder or path} is being written by {other} (lock {path}); wait for it to finish, or stop it, then rerun"


def refuse_if_held(path: Path, holder: str) -> None:
    """flock's refusal (`blocking=False`) now, where another process holds the lock at `path`, taking nothing: for
    a check before minutes of work (a model load) whose lock is taken later, which still refuses a process that
    came meanwhile."""
    other = lock_holder(path)
    if other is not None:
        raise UserError(_held_line(path, holder, other))


def lock_holder(path: Path) -> str | None:
    """Who holds the flock at `path` (what it wrote in the file: "pid N on HOST"), None when nobody does; taking
    nothing for longer than the look. The one probe (an encode's early refusal, gc's look for live writers, the
    look for a live repair on a URL's working copy): a shared lock, so that two probes never see each other as a
    holder (every holder takes it exclusively: `flock`), of an existing file only, opened read-only (a read-only
    store or a dry run writes nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # never taken, or unlinked by its holder as it let go: nobody holds it
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        try:  # from the file opened: its holder may unlink it as it lets go (read by path: a traceback)
            return os.read(fd, 4096).decode(errors="replace").strip() or "another process"
        except OSError:
            return "another process"
    finally:
        os.close(fd)  # lets go of the probe's shared lock


def _open_lock(path: Path, changes_store: bool) -> int:
    """The lock file, opened for writing (created if new). The store's lock (`changes_store`) on a store that is
    read-only here (a read-only mount, another account's files) is said as that: the CLI's generic line was
    "cannot write output: ST/.store.lock is not writable"."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        from store.io_errors import is_not_writable

        if not changes_store or not is_not_writable(e):
            raise
        raise UserError(f"cannot take the store's lock file {path}: the store {path.parent} is read-only here "
                        f"({e.strerror or e}), and this command changes it; run it where the store is writable (a "
                        "read-write mount, an account that may write its files)") from None


def _names(path: Path, fd: int) -> bool:
    """Whether `path` is still the file open as `fd`."""
    try:
        there = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)


class HeldLock:
    """A non-blocking flock held until `release()` (the writer holds one for its whole life)."""

    def __init__(self, path: Path, holder: str) -> None:
        self._cm = flock(path, blocking=False, holder=holder)
        self._cm.__enter__()

    def release(self) -> None:
        if self._cm is not None:
            self._cm.__exit__(None, None, None)
            self._cm = None


# ---------------------------------------------------------------- fault injection for kill tests

CRASH_ENV = "STORE_CRASH_AT"


def crash_point(name: str) -> None:
    """Tests set STORE_CRASH_AT=<name> to SIGKILL this process at a named step (a real kill, no cleanup)."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


PAUSE_ENV = "STORE_PAUSE_AT"


def pause_point(name: str) -> None:
    """Tests set STORE_PAUSE_AT=<name> to have this process stop itself (SIGSTOP) the first time it reaches a
    named step, until they send SIGCONT: what the test does meanwhile happens at that very point, whatever
    the machine's load (a stop sent from outside lands wherever the process happens to be)."""
    if os.environ.get(PAUSE_ENV) == name:
        del os.environ[PAUSE_ENV]  # once
        os.kill(os.getpid(), signal.SIGSTOP)
