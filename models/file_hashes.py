"""sha256 of files' bytes, remembered by (real path, size, mtime, ctime) in a sqlite database under the user cache
folder, so unchanged multi-GB model weights or a dataset's images are read once, not on every stage run.

Used by the model fingerprints (`models.loading`) and by the source identity of resize-bucket
(`stages.resize.content`). The identity is always the bytes: a file whose size or mtime changed (touched,
rewritten, copied) is read and hashed again, and keeps its identity when its bytes are the same. The inode change
time (ctime) counts too: no tool can set it, so weights rewritten in place with the same size and their mtime put
back (`cp -p`, `rsync -a --inplace`, a download tool restoring the upload time) are not taken for the old ones.
Where times are whole seconds, a file changed less than `RACY_NS` before it was read is not remembered: a same-size
rewrite within that second would keep all three.

A file found under another path (its folder moved or renamed, or mounted elsewhere: a bind mount) is known by its
inode: the same device, inode, size, mtime and ctime as a row hashed under its old path (a rename changes none of
these for the files inside a folder, and any write changes the ctime), so a moved million-file dataset is not read
again. Only on local file systems whose inode numbers are the file's own (`STABLE_INODES`); elsewhere (network
and FUSE file systems, FAT) a moved file is hashed again.

sqlite (stdlib) rather than one JSON file: at a million source files the JSON was ~150 MB read and rewritten
whole on every run; here each file is one row looked up by its primary key, new hashes are written in batched
transactions (a killed run keeps what it flushed), and the WAL journal with a busy timeout lets concurrent
processes (ranks, stages run side by side) share one cache. It is a cache only: when it cannot be opened or
written, files are hashed without it, and a damaged database file is replaced.

A cache folder on a network file system (a home folder on NFS, Lustre, GPFS, ...: `network_fs`) holds one
database per host, in sqlite's rollback journal: WAL keeps its index in memory shared through an mmapped file,
which only processes of one host share (sqlite: "WAL does not work over a network filesystem"), and sqlite's
locks across hosts rely on the mount's lock service (absent with `nolock`). Per host, only one host's processes
open each file; its files are hashed once per host, as each node reads its own copy anyway. A host is a running
kernel (`schemas.host.host_id`: its boot id), not a host name: pods of one node, each with its own (often random)
name, share the kernel's memory and locks and so one database, reused by the next job there; two nodes given the
same fixed name (`docker --hostname`) never share one. A reboot starts a new database there (its files hashed once
again), and a host's database that no process has opened for 30 days is removed by the next open
(`drop_stale_hosts`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from schemas import interruptible
from schemas.file_digest import file_sha256
from schemas.host import host_id

log = logging.getLogger("models")

CACHE_NAME = "file-hashes.sqlite"  # one cache for every caller: a file hashed by one is known to the others
FLUSH_EVERY = 1000  # new hashes per write transaction
_SHA256 = re.compile(r"[0-9a-f]{64}")  # what a row must hold to be trusted (a damaged row is re-hashed)
_TABLE = ("CREATE TABLE IF NOT EXISTS sha256 (path TEXT PRIMARY KEY, size INTEGER NOT NULL, "
          "mtime_ns INTEGER NOT NULL, sha256 TEXT NOT NULL, ctime_ns INTEGER, dev INTEGER, ino INTEGER) WITHOUT ROWID")
# a cache written before ctime counted: the column added, its rows (ctime NULL) re-hashed once
_ADD_CTIME = "ALTER TABLE sha256 ADD COLUMN ctime_ns INTEGER"
# ... before inodes were recorded: its rows are found by path only (NULL dev, ino)
_ADD_INODE = ("ALTER TABLE sha256 ADD COLUMN dev INTEGER", "ALTER TABLE sha256 ADD COLUMN ino INTEGER")
_INODE_INDEX = "CREATE INDEX IF NOT EXISTS sha256_inode ON sha256 (dev, ino)"
_UPSERT = ("INSERT INTO sha256 (path, size, mtime_ns, ctime_ns, sha256, dev, ino) VALUES (?, ?, ?, ?, ?, ?, ?) "
           "ON CONFLICT(path) DO UPDATE SET size = excluded.size, mtime_ns = excluded.mtime_ns, "
           "ctime_ns = excluded.ctime_ns, sha256 = excluded.sha256, dev = excluded.dev, ino = excluded.ino")
_BY_INODE = ("SELECT sha256 FROM sha256 WHERE dev = ? AND ino = ? AND size = ? AND mtime_ns = ? AND ctime_ns = ? "
             "LIMIT 1")
# local file systems whose inode numbers belong to the file for its life and whose ctime has ns resolution: a
# row's (dev, ino, size, mtime, ctime) is that file, unchanged. Not FAT/exFAT (inode numbers made up from the
# directory slot, reused by the next file there, 2 s times), not network or FUSE file systems (numbers made up by
# the client or another host's)
STABLE_INODES = {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "overlay", "bcachefs"}
_INT64 = 1 << 63  # sqlite's INTEGER: a larger inode number is not recorded
# A file with whole-second times (a file system stamping at 1 s: ext3, HFS+, some NFS servers; 2 s: FAT) changed
# within this long before its bytes were read is hashed, not remembered ("racy git"): a same-size rewrite in the
# same second as the read keeps its size, mtime and ctime, and its new bytes would pass for the hashed ones for
# ever. Such a file is read again by the next run (and remembered once it is older). Times with nanoseconds (ext4,
# xfs, btrfs, tmpfs) are trusted as they are.
RACY_NS = 2_000_000_000
_SECOND_NS = 1_000_000_000


_OPEN_WAIT_S = 30.0  # as long as the busy timeout a write waits


# file systems shared by several hosts (kernel names as in /proc/self/mountinfo); any FUSE one ("fuse.TYPE":
# s3fs, gcsfuse, rclone, blobfuse2, ...) counts too but the known local ones (a local one taken for shared only
# gets a database of its own: a rootless container's root is fuse-overlayfs)
LOCAL_FUSE = {"fuse.fuse-overlayfs", "fuse.lxcfs", "fuse.gvfsd-fuse", "fuse.portal", "fuse.gocryptfs", "fuse.encfs",
              "fuse.squashfuse"}
NETWORK_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "fuse.ceph-fuse",
              "glusterfs", "fuse.glusterfs", "fuse.sshfs", "9p", "afs", "gfs2", "ocfs2", "panfs", "wekafs",
              "fuse.juicefs", "orangefs", "virtiofs"}


MOUNTINFO = "/proc/self/mountinfo"  # this process's mount table (Linux; elsewhere: none, as a local disk)


def network_fs(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the network file system holding `path` (which may not exist yet), else None.
    `mountinfo`: the text of /proc/self/mountinfo (read when None; unreadable: None, as a local disk)."""
    kind = mount_type(path, mountinfo)
    shared = kind in NETWORK_FS or (kind or "").startswith("fuse.") and kind not in LOCAL_FUSE
    return kind if shared else None


def mount_type(path: Path | str, mountinfo: str | None = None) -> str | None:
    """The type of the file system holding `path` (its innermost mount); None when the mount table is unreadable."""
    # links resolved as far as the path exists; first: walking the path mounts an automounted (autofs) folder
    real = os.path.realpath(path)
    if mountinfo is None:
        try:
            mountinfo = Path(MOUNTINFO).read_text()
        except OSError:
            return None
    best, kind = "", None
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        parts, tail = fields.split(), rest.split()
        if len(parts) < 5 or not tail:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])  # "\040": a space
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):  # the innermost mount (the last of equal ones: mounted over)
            best, kind = point, tail[0]
    return kind


def _connect(path: Path, journal: str = "WAL") -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + _OPEN_WAIT_S
    pause = 0.01
    while True:
        db = sqlite3.connect(path, timeout=_OPEN_WAIT_S)  # waits for another process's write transaction
        try:
            db.execute(f"PRAGMA journal_mode={journal}")  # WAL: readers never wait for a writer
            db.execute("PRAGMA synchronous=NORMAL")  # a cache: a power cut may lose the last batch, never corrupt it
            db.execute(_TABLE)
            columns = {row[1] for row in db.execute("PRAGMA table_info(sha256)")}
            if "ctime_ns" not in columns:
                db.execute(_ADD_CTIME)
            if "ino" not in columns:
                for add in _ADD_INODE:
                    db.execute(add)
            db.execute(_INODE_INDEX)
            db.commit()
            return db
        except sqlite3.OperationalError as e:
            db.close()
            # Processes opening a new database at once (ranks starting together): sqlite answers "database is
            # locked" at once here, without its busy handler (measured: 7 of 15 rounds of 4 processes lost the
            # cache), so this retries what the timeout would have waited for.
            if "locked" not in str(e) and "busy" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        except BaseException:
            db.close()
            raise


def _open(path: Path, journal: str = "WAL") -> sqlite3.Connection | None:
    try:
        return _connect(path, journal)
    except sqlite3.OperationalError as e:  # locked past the timeout, read-only or full disk: go on without
        log.warning("file hash cache %s not usable (%s); hashing without it", path, e)
        return None
    except sqlite3.DatabaseError as e:  # not a database (damaged): start a new one
        log.warning("file hash cache %s is damaged (%s); starting a new one", path, e)
    except OSError as e:
        log.warning("file hash cache %s not usable (%s); hashing without it", path, e)
        return None
    try:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        return _connect(path, journal)
    except (sqlite3.Error, OSError) as e:
        log.warning("file hash cache %s not usable (%s); hashing without it", path, e)
        return None


STALE_HOST_DAYS = 30  # a host's database no process has opened for this long is removed by the next open


def drop_stale_hosts(own: Path, hosts: str, now: float | None = None) -> list[Path]:
    """On a shared cache folder each host (each boot of each node) gets its own database, up to ~150 MB at a
    million files, so a cluster's nodes coming, going and rebooting would fill the folder without end. Each open
    marks its own database as used (its mtime; a read-only open writes nothing else) and removes the databases of
    other hosts none has opened for `STALE_HOST_DAYS`: their host rebooted or left. A host that comes back later
    only hashes its files once again (a cache). `hosts`: the glob of every host's database. Returns what was
    removed."""
    now = time.time() if now is None else now
    try:
        os.utime(own)
    except OSError:
        pass
    removed = []
    for other in own.parent.glob(hosts):
        try:
            if other == own or now - other.stat().st_mtime < STALE_HOST_DAYS * 86400:
                continue
            other.unlink()
            Path(f"{other}-journal").unlink(missing_ok=True)
            removed.append(other)
        except OSError as e:  # gone meanwhile (another host's cleanup), or not ours to remove: left
            log.debug("file hash cache %s not removed (%s)", other, e)
    if removed:
        log.info("removed %d file hash cache(s) of hosts unseen for %d days: %s", len(removed), STALE_HOST_DAYS,
                 ", ".join(p.name for p in removed))
    return removed


def real_path(path: str | Path, folders: dict[str, str] | None) -> str:
    """`os.path.realpath(path)`, from its folder's real path kept in `folders` (folder -> real path, filled here)
    when `path` itself is no link: one lstat instead of one per path component (~30 us a file, minutes over an
    unchanged million-file source's rerun). `folders` None: `os.path.realpath` itself. The folders' links are
    taken as they were when first resolved: keep `folders` for one pass over the files only."""
    p = os.fspath(path)
    name, parent = os.path.basename(p), os.path.dirname(p)
    if folders is None or name in ("", ".", "..") or not parent or os.path.islink(p):
        return os.path.realpath(p)
    if parent not in folders:
        folders[parent] = os.path.realpath(parent)
    return os.path.join(folders[parent], name)


class FileHashes:
    """`with FileHashes("name.sqlite") as hashes: hashes.sha256(path)`; new hashes are saved in batches and
    when the block ends. `hashed` counts the files read in this block (cache misses). Paths are resolved with
    their folders' real paths kept for the block (`real_path`)."""

    def __init__(self, cache_name: str = CACHE_NAME) -> None:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        self.path = Path(base) / "qwen-edit-pipeline" / cache_name
        self.journal = "WAL"
        if network_fs(self.path) is not None:  # one database per host, rollback journal (module doc)
            stem, dot, ext = cache_name.rpartition(".")
            host = re.sub(r"[^A-Za-z0-9._-]", "_", host_id())
            self.path = self.path.with_name(f"{stem}.{host}.{ext}" if dot else f"{cache_name}.{host}")
            self.journal = "DELETE"
            self._hosts = f"{stem}.*.{ext}" if dot else f"{cache_name}.*"
        self._db: sqlite3.Connection | None = None
        # path -> size, mtime, ctime, sha256, dev, ino (dev and ino None: not recorded)
        self._pending: dict[str, tuple[int, int, int, str, int | None, int | None]] = {}
        self._stable: dict[int, bool] = {}  # st_dev -> its file system is in STABLE_INODES
        self._folders: dict[str, str] = {}  # folder -> its real path, for this block (`real_path`)
        self.hashed = 0

    def __enter__(self) -> "FileHashes":
        self._db = _open(self.path, self.journal)
        if self._db is not None and self.journal == "DELETE":
            drop_stale_hosts(self.path, self._hosts)
        return self

    def __exit__(self, *exc: object) -> None:
        self._flush()
        if self._db is not None:
            self._db.close()
            self._db = None

    @contextmanager
    def alone(self, key: str) -> Iterator[None]:
        """Hash inside the block holding a lock named by `key` (a model folder) next to the cache: processes of
        one node hashing the same files at once (the 8 ranks of a launch, each reading a 41 GB folder) take
        turns, so the first reads the files and caches them and the others find them cached (one read per node,
        not per rank). The new hashes are saved before the lock is released. Without a usable cache there is no
        lock: each process would read the files anyway."""
        if self._db is None:
            yield
            return
        # the node's kernel in the lock's name: a home folder shared by the nodes (NFS, Lustre) holds one cache,
        # and a lock every node's ranks took would make each node wait for the others to hash their own copies
        named = f"{host_id()}\0{key}"
        path = self.path.parent / "locks" / f"{hashlib.sha256(named.encode()).hexdigest()[:16]}.lock"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            log.warning("file hash lock %s not usable (%s); hashing without it", path, e)
            yield
            return
        try:
            try:
                # released by the kernel if this process dies; polled: a Ctrl-C another thread took ends the
                # wait for the node's other rank hashing a model (minutes)
                interruptible.flock(fd)
            except OSError as e:  # a file system without locks (NFS mounted `nolock`: ENOLCK): as without a cache
                log.warning("file hash lock %s not usable (%s); hashing without it", path, e)
            yield
            self._flush()
        finally:
            os.close(fd)

    def _known(self, real: str) -> tuple[int, int, int, str, int | None, int | None] | None:
        if real in self._pending:
            return self._pending[real]
        if self._db is None:
            return None
        try:
            return self._db.execute("SELECT size, mtime_ns, ctime_ns, sha256 FROM sha256 WHERE path = ?",
                                    (real,)).fetchone()
        except sqlite3.Error as e:
            self._give_up(e)
            return None

    def _flush(self) -> None:
        rows = [(p, *v) for p, v in self._pending.items()]
        self._pending.clear()
        if not rows or self._db is None:
            return
        try:
            with self._db:  # one transaction per batch
                self._db.executemany(_UPSERT, rows)
        except sqlite3.Error as e:  # a cache only: the cost is a re-hash next time
            self._give_up(e)

    def _give_up(self, e: Exception) -> None:
        log.warning("file hash cache %s failed (%s); hashing without it", self.path, e)
        if self._db is not None:
            self._db.close()
            self._db = None

    def cached(self, f: str | Path) -> str | None:
        """The file's sha256 when the cache knows its bytes (same size, mtime and ctime; under another path: same
        inode too), else None (not read)."""
        real = real_path(f, self._folders)
        return self._cached_at(real, os.stat(real))

    def _cached_at(self, real: str, st: os.stat_result) -> str | None:
        known = self._known(real)
        stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if known is not None and tuple(known[:3]) == stamp and isinstance(known[3], str) and _SHA256.fullmatch(known[3]):
            return known[3]
        moved = self._by_inode(real, st)
        if moved is not None:  # recorded under this path too: found by it next time
            self._remember(real, st, moved)
        return moved

    def _inode(self, real: str, st: os.stat_result) -> tuple[int, int] | None:
        """(dev, ino) of a file on a `STABLE_INODES` file system, else None."""
        if st.st_dev not in self._stable:
            self._stable[st.st_dev] = mount_type(real) in STABLE_INODES
        if not self._stable[st.st_dev] or not (0 <= st.st_dev < _INT64 and 0 <= st.st_ino < _INT64):
            return None
        return st.st_dev, st.st_ino

    def _by_inode(self, real: str, st: os.stat_result) -> str | None:
        """The sha256 recorded for this very file (same inode, size, mtime, ctime) under another path."""
        inode = self._inode(real, st) if self._db is not None else None
        if inode is None or self._db is None:
            return None
        try:
            row = self._db.execute(_BY_INODE, (*inode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)).fetchone()
        except sqlite3.Error as e:
            self._give_up(e)
            return None
        return row[0] if row is not None and isinstance(row[0], str) and _SHA256.fullmatch(row[0]) else None

    def _remember(self, real: str, st: os.stat_result, digest: str, read_at: int | None = None) -> None:
        """`read_at`: when the bytes hashed began to be read (time.time_ns; None: now). A file with whole-second
        times changed within `RACY_NS` of it is not remembered."""
        changed = max(st.st_mtime_ns, st.st_ctime_ns)
        if st.st_mtime_ns % _SECOND_NS == 0 and st.st_ctime_ns % _SECOND_NS == 0 and \
                (time.time_ns() if read_at is None else read_at) - changed < RACY_NS:
            return
        dev, ino = self._inode(real, st) or (None, None)
        self._pending[real] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest, dev, ino)
        if len(self._pending) >= FLUSH_EVERY:
            self._flush()

    def learn(self, f: str | Path, digest: str, before: os.stat_result, read_at: int | None = None) -> bool:
        """Record `digest`, the sha256 of `f`'s bytes read by the caller (a tar streamed whole), when the file is as
        it was when that read began (`before`: size, mtime, ctime, inode). Whether it is (then recorded, unless its
        times are whole seconds and it changed within `RACY_NS` of `read_at`: when that read began, time.time_ns;
        None: now - a learn at the commit, minutes after the stream, would pass any such file)."""
        real = real_path(f, self._folders)
        st = os.stat(real)
        if (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) != \
                (before.st_size, before.st_mtime_ns, before.st_ctime_ns, before.st_ino):
            return False
        self._remember(real, st, digest, read_at)
        return True

    def sha256(self, f: str | Path, digest: Callable[[str], str] | None = None) -> str:
        """The file's sha256: remembered for these very bytes, else `digest(real path)` (the sha256 of its bytes:
        a caller's hasher that also checks them in the same read, `stages.evaluate.lora_bytes.checked_sha256`;
        `file_sha256` looked up when called, not bound at definition: a test's spy of it sees every read),
        remembered when the file did not change while it was read."""
        real = real_path(f, self._folders)
        st = os.stat(real)
        stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if (known := self._cached_at(real, st)) is not None:  # resolved and stat'ed once, not again in `cached`
            return known
        read_at = time.time_ns()
        sha = (digest or file_sha256)(real)
        self.hashed += 1
        after = os.stat(real)
        if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == stamp and after.st_ino == st.st_ino:
            self._remember(real, after, sha, read_at)  # not changed while read
        return sha
