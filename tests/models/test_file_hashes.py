"""The path/size/mtime -> sha256 cache (models/file_hashes.py): identity is the bytes; the cache survives the
process, is shared by concurrent processes, and is only a cache (a damaged file is replaced)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import models.file_hashes as fh
from schemas import host
from models.file_hashes import CACHE_NAME, FileHashes
from stages.resize.content import content_listing_hash

ROOT = Path(__file__).resolve().parents[2]
HASH_ALL = """
import sys
from models.file_hashes import CACHE_NAME, FileHashes
with FileHashes("t.sqlite") as h:
    for p in sys.argv[1:]:
        h.sha256(p)
print(h.hashed)
"""


def _hash_in_process(files: list[Path], cache: Path) -> subprocess.Popen:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", HASH_ALL, *map(str, files)], env=env, stdout=subprocess.PIPE,
                            text=True)


def _files(d: Path, n: int, tag: str = "") -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        p = d / f"f{i:04d}.bin"
        p.write_bytes(f"{tag}{i}".encode() * 50)
        os.utime(p, ns=(10**18, 10**18 + i))
        out.append(p)
    return out


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_survives_the_process_and_identity_is_the_bytes(tmp_path, cache, monkeypatch) -> None:
    files = _files(tmp_path / "src", 30)
    p = _hash_in_process(files, cache)
    assert p.communicate()[0].strip() == "30" and p.returncode == 0
    # A second process: every hash comes from the cache (reading a file would fail here), and is right.
    real = fh.file_sha256
    monkeypatch.setattr(fh, "file_sha256", lambda path: pytest.fail(f"{path} read despite the cache"))
    with FileHashes("t.sqlite") as h:
        assert [h.sha256(f) for f in files] == [_sha(f) for f in files] and h.hashed == 0
    monkeypatch.setattr(fh, "file_sha256", real)
    # Changed bytes, same size: re-hashed (mtime moved). Touched, same bytes: re-read, same identity.
    files[0].write_bytes(files[0].read_bytes().replace(b"0", b"9"))
    os.utime(files[1], ns=(2 * 10**18, 2 * 10**18))
    with FileHashes("t.sqlite") as h:
        assert h.sha256(files[0]) == _sha(files[0]) != _sha(files[2])
        before = _sha(files[1])
        assert h.sha256(files[1]) == before and h.hashed == 2
        assert h.sha256(files[1]) == before and h.hashed == 2  # remembered before the batch is written
    with FileHashes("t.sqlite") as h:  # the new stats are the ones remembered (one row per path)
        assert [h.sha256(f) for f in files] == [_sha(f) for f in files] and h.hashed == 0
        assert h._db.execute("SELECT count(*) FROM sha256").fetchone()[0] == 30


def test_concurrent_processes_share_one_cache(tmp_path, cache) -> None:
    a, b = _files(tmp_path / "a", 1500, "a"), _files(tmp_path / "b", 1500, "b")  # > FLUSH_EVERY: several batches
    procs = [_hash_in_process(a + b[:200], cache), _hash_in_process(b + a[:200], cache)]
    counts = [int(p.communicate()[0]) for p in procs]
    # Every file is read at least once, the 400 shared ones at most twice; who reads a shared one is timing (a
    # process started late finds its first 200 already written by the other: CI saw [1700, 1300]).
    assert 3000 <= sum(counts) <= 3400 and all(1300 <= c <= 1700 for c in counts), counts
    assert all(p.returncode == 0 for p in procs)
    with FileHashes("t.sqlite") as h:
        assert all(h.sha256(f) == _sha(f) for f in a + b) and h.hashed == 0


OPEN_TOGETHER = """
import sys, time
from pathlib import Path
from models import file_hashes as fh
folder, start = Path(sys.argv[1]), float(sys.argv[2])
lost = 0
for k in range(int(sys.argv[3])):
    time.sleep(max(0.0, start + 0.25 * k - time.time() - 0.02))  # asleep till just before (four spinning
    while time.time() < start + 0.25 * k:  # processes would hold a 2-core machine); then every process opens
        pass  # round k's new database at the same instant
    db = fh._open(folder / f"round-{k}.sqlite")
    lost += db is None
    if db is not None:
        db.close()
print(lost)
"""


def test_processes_opening_a_new_cache_at_once_all_get_it(tmp_path) -> None:
    """Ranks start together on a fresh cache: sqlite answered "database is locked" at once (no busy wait) and a
    process went on without the cache (CI: 1300 hashes lost; here about every second round of 4 processes)."""
    import time

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start, rounds = time.time() + 3.0, 8  # after the interpreters' imports
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_TOGETHER, str(tmp_path), str(start), str(rounds)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [o.strip() for o, _ in outs] == ["0"] * 4, [e[-500:] for _, e in outs]


def test_damaged_cache_is_replaced(tmp_path, cache) -> None:
    files = _files(tmp_path / "src", 3)
    (cache / "qwen-edit-pipeline").mkdir(parents=True)
    (cache / "qwen-edit-pipeline" / "t.sqlite").write_bytes(b"not a database" * 100)
    with FileHashes("t.sqlite") as h:
        assert [h.sha256(f) for f in files] == [_sha(f) for f in files] and h.hashed == 3
    with FileHashes("t.sqlite") as h:
        assert [h.sha256(f) for f in files] == [_sha(f) for f in files] and h.hashed == 0


def test_source_identity_ignores_touch_and_copy(tmp_path, cache) -> None:
    src = tmp_path / "src"
    files = _files(src / "target", 5)  # a folder source: target/ holds the images
    first = content_listing_hash(src)
    for f in files:
        os.utime(f, ns=(3 * 10**18, 3 * 10**18))
    copy = tmp_path / "copy"
    (copy / "target").mkdir(parents=True)
    for f in files:
        (copy / "target" / f.name).write_bytes(f.read_bytes())
    assert content_listing_hash(src) == first == content_listing_hash(copy)
    files[2].write_bytes(b"other bytes")
    assert content_listing_hash(src) != first
    assert (cache / "qwen-edit-pipeline" / CACHE_NAME).is_file()


def test_a_damaged_row_is_not_trusted(tmp_path, cache) -> None:
    """A row whose hash is not a sha256 (a torn or hand-edited cache) is re-hashed and replaced, never returned."""
    f = _files(tmp_path / "src", 1)[0]
    with FileHashes() as h:
        h.sha256(f)
    st = f.stat()
    for bad in ("", "0" * 63, "x" * 64, 12345):
        with FileHashes() as h:
            with h._db:
                h._db.execute("UPDATE sha256 SET sha256 = ? WHERE path = ?", (bad, os.path.realpath(f)))
        with FileHashes() as h:
            assert h.sha256(f) == _sha(f) and h.hashed == 1, bad
        assert f.stat().st_mtime_ns == st.st_mtime_ns
    with FileHashes() as h:  # the replaced row is trusted again
        assert h.sha256(f) == _sha(f) and h.hashed == 0


def test_model_and_source_hashes_share_one_cache(tmp_path, cache) -> None:
    """Source images hashed by resize-bucket are known to the model fingerprint's cache (one database file)."""
    src = tmp_path / "src"
    files = _files(src / "target", 3)
    content_listing_hash(src)
    assert [p.name for p in (cache / "qwen-edit-pipeline").glob("*.sqlite")] == [CACHE_NAME]
    with FileHashes() as h:
        assert [h.sha256(f) for f in files] == [_sha(f) for f in files] and h.hashed == 0


def test_weights_rewritten_in_place_with_their_mtime_put_back_are_hashed_again(tmp_path, cache) -> None:
    """Same path, same size, mtime restored (`cp -p`, `rsync -a --inplace`): other bytes, so another identity (the
    model fingerprint follows). Before: the cache keyed on (path, size, mtime) returned the old weights' hash."""
    f = _files(tmp_path / "model", 1)[0]
    with FileHashes() as h:
        old = h.sha256(f)
    st = f.stat()
    f.write_bytes(f.read_bytes().replace(b"0", b"7"))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with FileHashes() as h:
        assert h.sha256(f) == _sha(f) != old and h.hashed == 1


def test_a_cache_written_before_ctime_counted_is_upgraded(tmp_path, cache) -> None:
    """A cache file of the earlier layout (no ctime column) is kept and upgraded: its rows are hashed again once."""
    import sqlite3

    f = _files(tmp_path / "src", 1)[0]
    db_path = cache / "qwen-edit-pipeline" / CACHE_NAME
    db_path.parent.mkdir(parents=True)
    with sqlite3.connect(db_path) as db:
        db.execute("CREATE TABLE sha256 (path TEXT PRIMARY KEY, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, "
                   "sha256 TEXT NOT NULL) WITHOUT ROWID")
        db.execute("INSERT INTO sha256 VALUES (?, ?, ?, ?)", (os.path.realpath(f), f.stat().st_size,
                                                            f.stat().st_mtime_ns, "0" * 64))
    db.close()
    with FileHashes() as h:
        assert h.sha256(f) == _sha(f) and h.hashed == 1
    with FileHashes() as h:
        assert h.sha256(f) == _sha(f) and h.hashed == 0


def test_a_moved_folder_is_known_by_its_inodes_not_read_again(tmp_path, cache, monkeypatch) -> None:
    """A folder renamed (or its files reached by another path: a bind mount): same device, inode, size, mtime and
    ctime, so the same bytes: not read again, and recorded under the new path. A file rewritten there (its mtime
    put back) is read; on a file system whose inode numbers are made up (FAT, network, FUSE) everything is."""
    files = _files(tmp_path / "a", 5)
    with FileHashes() as h:
        digests = [h.sha256(f) for f in files]
    assert h.hashed == 5
    (tmp_path / "a").rename(tmp_path / "b")
    moved = [tmp_path / "b" / f.name for f in files]
    with FileHashes() as h:
        assert [h.sha256(f) for f in moved] == digests and h.hashed == 0  # before: 5
    with FileHashes() as h:  # found by the new path now
        assert h._known(os.path.realpath(moved[0])) is not None and h.sha256(moved[0]) == digests[0]
    st = moved[1].stat()
    moved[1].write_bytes(moved[1].read_bytes().replace(b"1", b"7"))
    os.utime(moved[1], ns=(st.st_atime_ns, st.st_mtime_ns))
    with FileHashes() as h:
        assert h.sha256(moved[1]) == _sha(moved[1]) != digests[1] and h.hashed == 1
    monkeypatch.setattr(fh, "mount_type", lambda path, mountinfo=None: "vfat")
    (tmp_path / "b").rename(tmp_path / "c")
    with FileHashes() as h:
        assert [h.sha256(tmp_path / "c" / f.name) for f in files[2:]] == digests[2:] and h.hashed == 3


def test_a_cache_written_before_inodes_were_recorded_is_upgraded(tmp_path, cache) -> None:
    """The earlier layout (no dev/ino columns): kept, its rows still found by path, the columns added."""
    import sqlite3

    f = _files(tmp_path / "src", 1)[0]
    db_path = cache / "qwen-edit-pipeline" / CACHE_NAME
    db_path.parent.mkdir(parents=True)
    st = f.stat()
    with sqlite3.connect(db_path) as db:
        db.execute("CREATE TABLE sha256 (path TEXT PRIMARY KEY, size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, "
                   "sha256 TEXT NOT NULL, ctime_ns INTEGER) WITHOUT ROWID")
        db.execute("INSERT INTO sha256 VALUES (?, ?, ?, ?, ?)", (os.path.realpath(f), st.st_size, st.st_mtime_ns,
                                                               _sha(f), st.st_ctime_ns))
    db.close()
    with FileHashes() as h:
        assert h.sha256(f) == _sha(f) and h.hashed == 0
        assert {"dev", "ino"} <= {row[1] for row in h._db.execute("PRAGMA table_info(sha256)")}


@pytest.mark.timeout(60)  # without a lock per node, node b's turn waits for node a's forever
def test_hashing_alone_is_per_node_not_across_nodes_sharing_a_home(cache, monkeypatch) -> None:
    """The ranks of one node hash a model folder in turn (`FileHashes.alone`); two nodes sharing one home folder
    (one hash cache on NFS) do not wait for each other: each hashes its own copy of the folder."""
    import fcntl

    with FileHashes() as node_a, FileHashes() as node_b:
        monkeypatch.setattr(fh, "host_id", lambda: "node-a")
        with node_a.alone("/models/qwen"):
            monkeypatch.setattr(fh, "host_id", lambda: "node-b")
            free = []
            for lock in sorted((cache / "qwen-edit-pipeline" / "locks").glob("*.lock")):
                fd = os.open(lock, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # node a's lock is held: refused at once
                    free.append(lock)
                except BlockingIOError:
                    pass
                finally:
                    os.close(fd)
            assert free == []  # the held lock is node a's
            with node_b.alone("/models/qwen"):  # a lock of its own (the same one would wait forever here)
                pass
            assert len(list((cache / "qwen-edit-pipeline" / "locks").glob("*.lock"))) == 2


def test_a_file_system_without_locks_hashes_without_the_lock(tmp_path, cache, monkeypatch) -> None:
    """flock refused (NFS mounted `nolock` answers ENOLCK): the model is hashed all the same, as without a
    cache, instead of the train start failing on it."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    files = _files(tmp_path / "model", 3)
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with FileHashes() as hashes, hashes.alone(str(tmp_path / "model")):
        got = [hashes.sha256(f) for f in files]
    assert got == [_sha(f) for f in files]


MOUNTINFO = """22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:50 / /home rw,relatime shared:20 - nfs4 filer:/export/home rw,vers=4.2
41 40 8:2 / /home/u/scratch\\040disk rw,relatime shared:21 - ext4 /dev/sdb1 rw
"""


def test_a_cache_on_a_network_file_system_is_one_rollback_database_per_host(tmp_path, cache, monkeypatch) -> None:
    """sqlite's WAL needs memory shared by every process of the database, which processes of two hosts never
    share: a cache folder on NFS (a shared home) holds one database per host, in the rollback journal. Before:
    one WAL database for every node of the cluster."""
    import socket
    import sqlite3

    assert fh.network_fs(Path("/home/u/.cache/x/y"), MOUNTINFO) == "nfs4"  # the innermost mount, parents too
    assert fh.network_fs(Path("/home/u/scratch disk/c"), MOUNTINFO) is None  # "\040": a space
    assert fh.network_fs(Path("/var/tmp"), MOUNTINFO) is None

    files = _files(tmp_path / "model", 3)
    monkeypatch.setattr(fh, "network_fs", lambda path, mountinfo=None: "nfs4")
    folder = cache / "qwen-edit-pipeline"
    boot = tmp_path / "boot_id"
    monkeypatch.setattr(host, "BOOT_ID", str(boot))
    # a host is a running kernel: pods of node a (random host names) share its database, and node b, given the
    # same host name as a pod of node a (`--hostname`), has its own
    for kernel, name, hashed in (("node-a", "pod-1", 3), ("node-a", "pod-2", 0), ("node-b", "pod-2", 3)):
        boot.write_text(kernel + "\n")
        monkeypatch.setattr(socket, "gethostname", lambda name=name: name)
        with FileHashes() as h:
            assert [h.sha256(f) for f in files] == [_sha(f) for f in files] and h.hashed == hashed
            assert h.path == folder / f"file-hashes.{kernel}.sqlite"
            with sqlite3.connect(h.path) as db:
                assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
            db.close()
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == ["file-hashes.node-a.sqlite",
                                                                       "file-hashes.node-b.sqlite"]  # no -wal
    boot.unlink()  # no /proc (not Linux): the host name
    with FileHashes() as h:
        assert h.path == folder / "file-hashes.pod-2.sqlite"


def test_a_fuse_or_automounted_cache_folder_counts_as_shared(tmp_path, monkeypatch) -> None:
    """Any FUSE file system (s3fs, gcsfuse, rclone: a bucket mounted on every node) is taken as shared, and an
    automounted (autofs) folder is judged by what walking its path mounts there. Before: a FUSE type outside the
    list was a local disk (one WAL database for every node), and the mount table was read before the walk that
    mounts the folder, which then still showed autofs there (a local disk)."""
    import os

    fuse = MOUNTINFO + "50 22 0:60 / /mnt/bucket rw,nosuid shared:30 - fuse.s3fs s3fs rw,user_id=0\n"
    assert fh.network_fs(Path("/mnt/bucket/cache/x"), fuse) == "fuse.s3fs"
    rootless = "1 0 0:30 / / rw,relatime - fuse.fuse-overlayfs fuse-overlayfs rw,user_id=0\n"  # a local one
    assert fh.network_fs(Path("/root/.cache/x"), rootless) is None
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTINFO + "60 22 0:70 / /shared rw,relatime shared:40 - autofs systemd-1 rw,fd=5\n")
    real_realpath = os.path.realpath

    def walk_mounts(path, *a, **k):  # the kernel mounts /shared/cache as the walk enters it
        with open(table, "a") as f:
            f.write("61 60 0:71 / /shared/cache rw,relatime shared:41 - nfs4 filer:/cache rw,vers=4.2\n")
        return real_realpath(path, *a, **k)

    monkeypatch.setattr(fh, "MOUNTINFO", str(table), raising=False)
    monkeypatch.setattr(os.path, "realpath", walk_mounts)
    assert fh.network_fs(Path("/shared/cache/qwen-edit-pipeline/file-hashes.sqlite")) == "nfs4"


def test_hashing_a_model_folder_shows_its_bytes_per_second_once(tmp_path, cache, capsys) -> None:
    """Hashing a model folder (41 GB at train start) shows a progress bar of the bytes read, with their rate; a
    process that finds the folder cached (the node's other ranks, the next stage) shows none."""
    from models.loading import _files_fingerprint

    root = tmp_path / "model"
    _files(root / "transformer", 4)
    first = _files_fingerprint(root, None)
    err = capsys.readouterr().err
    assert "hash model" in err and "B/s" in err and "100%" in err, err
    assert _files_fingerprint(root, None) == first
    assert "hash model" not in capsys.readouterr().err


def test_databases_of_hosts_unseen_for_a_month_are_removed(tmp_path, cache, monkeypatch) -> None:
    """A shared cache folder gains a database per node boot (each up to ~150 MB at a million files); before,
    none was ever removed. An open marks its own as used and removes those no host opened for 30 days (their
    rollback journals too); a younger one, a local cache's database and other files stay."""
    monkeypatch.setattr(fh, "network_fs", lambda path, mountinfo=None: "nfs4")
    boot = tmp_path / "boot_id"
    monkeypatch.setattr(host, "BOOT_ID", str(boot))
    folder = cache / "qwen-edit-pipeline"
    files = _files(tmp_path / "model", 2)
    for kernel in ("old-boot", "recent-boot", "this-boot"):
        boot.write_text(kernel)
        with FileHashes() as h:
            h.sha256(files[0])
    (folder / "file-hashes.old-boot.sqlite-journal").write_bytes(b"left by a killed write")
    (folder / fh.CACHE_NAME).write_bytes(b"")  # a local (WAL) cache's database: not a host's
    day = 86400
    now = time.time()
    for kernel, age in (("old-boot", 31), ("recent-boot", 29), ("this-boot", 40)):
        os.utime(folder / f"file-hashes.{kernel}.sqlite", (now - age * day, now - age * day))
    with FileHashes() as h:  # this boot's database, unopened for 40 days itself: marked used, not removed
        assert h.sha256(files[0]) == _sha(files[0]) and h.hashed == 0
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == sorted([
        fh.CACHE_NAME, "file-hashes.recent-boot.sqlite", "file-hashes.this-boot.sqlite"])
    assert time.time() - (folder / "file-hashes.this-boot.sqlite").stat().st_mtime < day


def test_paths_resolve_as_realpath_does_with_each_folder_resolved_once(tmp_path, cache, monkeypatch) -> None:
    """`real_path` (every hash's key, one lstat a file instead of one per path component: bench/source_hash_rerun.py)
    gives `os.path.realpath`'s answer for plain files, linked files and folders, `..`, relative and missing paths; a
    rerun over an unchanged source through it finds every file in the cache, and each folder is resolved once."""
    real = tmp_path / "real" / "deep"
    files = _files(real, 3)
    (tmp_path / "linked").symlink_to(real)  # a folder link
    (real / "alias.png").symlink_to(files[0])  # a file link
    (real / "dangling.png").symlink_to(real / "gone.png")
    monkeypatch.chdir(tmp_path)
    paths = [*files, tmp_path / "linked" / files[1].name, real / "alias.png", real / "dangling.png",
             real / "missing.png", tmp_path / "linked" / ".." / "real" / "deep" / files[2].name,
             Path("linked") / files[0].name, Path(files[0].name), real / ".", tmp_path / "linked" / "..", real]
    folders: dict[str, str] = {}
    assert [fh.real_path(p, folders) for p in paths] == [os.path.realpath(p) for p in paths]
    assert [fh.real_path(p, None) for p in paths] == [os.path.realpath(p) for p in paths]

    with FileHashes() as h:
        first = [h.sha256(f) for f in files]
    resolved: list[str] = []
    monkeypatch.setattr(fh.os.path, "realpath", lambda p, real=os.path.realpath: resolved.append(p) or real(p))
    with FileHashes() as h:
        again = [h.sha256(p) for p in [*files, tmp_path / "linked" / files[1].name]]
    assert again == [*first, first[1]] and h.hashed == 0
    under = [str(p) for p in resolved if str(p).startswith((str(real), str(tmp_path / "linked")))]
    folders_once = under.count(str(real)) == 1 and under.count(str(tmp_path / "linked")) == 1
    assert folders_once and len(under) <= 3, under  # besides: the mount type of the files' device, looked up once


def _stamped_in_whole_seconds(monkeypatch, f, second: int) -> None:
    """`f`'s stat as a whole-second file system reports it: mtime and ctime both `second` (ns)."""
    real_stat, real_path = os.stat, os.path.realpath(f)

    class Coarse:
        def __init__(self, st):
            self._st = st

        def __getattr__(self, name):
            if name in ("st_mtime_ns", "st_ctime_ns"):
                return second
            return second / 1e9 if name in ("st_mtime", "st_ctime") else getattr(self._st, name)

    monkeypatch.setattr(fh.os, "stat", lambda p, *a, **k: Coarse(real_stat(p, *a, **k))
                        if os.fspath(p) == real_path else real_stat(p, *a, **k))


def test_a_same_second_rewrite_on_a_whole_second_file_system_is_read_again(tmp_path, cache, monkeypatch) -> None:
    """ext3, HFS+, FAT and some NFS servers stamp whole seconds: a caption fixed by one letter within the second
    it was hashed in keeps its size, mtime and ctime. Its hash is not remembered while that second can still
    change it ("racy git"), so the next run reads the new bytes; once older, it is remembered (read once)."""
    f = tmp_path / "sample.txt"
    f.write_bytes(b"a cat")
    second = 1_700_000_000 * 10**9  # the second both writes fall in, as such a file system stamps them
    _stamped_in_whole_seconds(monkeypatch, f, second)

    class Clock:  # time.time_ns at a given offset into that second; the rest of `time` as it is
        now = second + 300_000_000

        def __getattr__(self, name):
            return getattr(time, name)

        def time_ns(self):
            return self.now

    clock = Clock()
    monkeypatch.setattr(fh, "time", clock)
    with FileHashes("t.sqlite") as h:
        assert h.sha256(f) == hashlib.sha256(b"a cat").hexdigest()
    f.write_bytes(b"a car")  # the same size, the same second: the same (size, mtime, ctime)
    clock.now = second + 700_000_000
    with FileHashes("t.sqlite") as h:
        assert h.sha256(f) == hashlib.sha256(b"a car").hexdigest() and h.hashed == 1
    clock.now = second + 5 * 10**9  # seconds later: nothing can change it unseen any more, remembered
    with FileHashes("t.sqlite") as h:
        assert h.sha256(f) == hashlib.sha256(b"a car").hexdigest() and h.hashed == 1
    with FileHashes("t.sqlite") as h:
        assert h.sha256(f) == hashlib.sha256(b"a car").hexdigest() and h.hashed == 0


def test_a_streamed_hash_learned_later_is_judged_by_when_its_read_began(tmp_path, cache, monkeypatch) -> None:
    """`learn` records the sha256 a resize stream took of a tar, at the commit, minutes after the read. On a
    whole-second file system a same-size rewrite in the second the stream began keeps (size, mtime, ctime): judged
    by the time of the learn (long after) the stream's digest of the old bytes was remembered for ever; judged by
    when the read began, it is not, and the next run reads the new bytes."""
    f = tmp_path / "shard.tar"
    f.write_bytes(b"a cat")
    second = 1_700_000_000 * 10**9
    _stamped_in_whole_seconds(monkeypatch, f, second)

    class Clock:
        now = second + 10 * 10**9  # the commit, seconds after the stream

        def __getattr__(self, name):
            return getattr(time, name)

        def time_ns(self):
            return self.now

    monkeypatch.setattr(fh, "time", Clock())
    streamed = hashlib.sha256(b"a cat").hexdigest()  # the stream began at second + 0.3 s
    f.write_bytes(b"a car")  # the same size, the same second: the same stamp
    with FileHashes("t.sqlite") as h:
        assert h.learn(f, streamed, fh.os.stat(f), read_at=second + 300_000_000)
    with FileHashes("t.sqlite") as h:
        assert h.sha256(f) == hashlib.sha256(b"a car").hexdigest() and h.hashed == 1
