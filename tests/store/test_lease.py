"""Read leases (store/lease.py): `store gc` keeps a version a live reader names - this process, another
process, a process on another host refreshed lately - and removes it, with the lease file, once the reader is
gone (kill -9, a reused pid, a remote lease not refreshed for STALE_SECONDS)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from store import Store
from store import gc, lease
from store_samples import fill, read_only_open


def two_versions(store: Store) -> None:
    fill(store, 6, tag="a")
    fill(store, 6, tag="b")  # v2 becomes current: v1 is what gc would remove
    assert store.tables()["vae"] == 2 and store.versions("vae") == [1, 2]


def lease_files(store: Store) -> list[Path]:
    return sorted((store.root / lease.LEASES_DIR).glob("*.json"))


def test_a_lease_of_this_process_keeps_the_version_until_released(store):
    two_versions(store)
    held = lease.hold(store.root, {"vae": 1}, "a test reader")
    assert held.versions == {"vae": [1]} and lease_files(store) == [held.path]
    messages: list[str] = []
    p = gc.collect(store.root, dry_run=True, echo=messages.append)
    assert ("vae", 1) in p.keep and not p.remove
    assert any(m.startswith("keep vae/v1: not current, but read by a test reader (pid") for m in messages), messages
    gc.collect(store.root, echo=messages.append)
    assert store.versions("vae") == [1, 2]
    held.release()
    assert lease_files(store) == []
    gc.collect(store.root, echo=messages.append)
    assert store.versions("vae") == [2]


def test_current_resolved_under_the_lock_and_a_removed_version_not_leased(store):
    two_versions(store)
    held = lease.hold(store.root, {"vae": None, "text": None}, "reader")
    assert held.versions == {"vae": [2]}  # the current one; a table the store lacks is left out
    gc.collect(store.root, echo=lambda m: None)  # removes v1
    assert held.add("vae", 1) is False and held.versions == {"vae": [2]}
    held.release()


READER = """
import sys, time
from store.lease import hold
held = hold(sys.argv[1], {"vae": 1}, "reader process")
print(held.path, flush=True)
time.sleep(120)
"""


def test_a_live_reader_process_keeps_the_version_a_killed_one_does_not(store):
    two_versions(store)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", READER, str(store.root)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        path = Path(proc.stdout.readline().strip())
        assert path.is_file() and json.loads(path.read_text())["pid"] == proc.pid
        assert not gc.collect(store.root, echo=lambda m: None).remove  # alive: kept
        assert store.versions("vae") == [1, 2]
    finally:
        proc.send_signal(signal.SIGKILL)  # no cleanup: the lease file stays behind
        proc.wait()
    assert path.is_file()
    messages: list[str] = []
    p = gc.collect(store.root, echo=messages.append)
    assert [f.path for f in p.dead_leases] == [path] and not path.exists()
    assert any("remove the lease of a gone reader: reader process" in m and "is gone" in m for m in messages)
    assert store.versions("vae") == [2]


def test_a_reused_pid_and_remote_leases_judged_by_start_time_and_refresh_age(tmp_path):
    mine = lease.Lease(tmp_path, "me").record()
    assert lease.judge(tmp_path / "a.json", mine, time.time()).live
    reused = {**mine, "pid_start": (mine["pid_start"] or 0) + 1}  # our pid, but another process's start time
    assert not lease.judge(tmp_path / "a.json", reused, time.time()).live
    remote = {**mine, "host": "another-host", "boot_id": "another-kernel"}
    now = time.time()
    assert lease.judge(tmp_path / "a.json", remote, now - 60, now).live
    old = lease.judge(tmp_path / "a.json", remote, now - lease.STALE_SECONDS - 1, now)
    assert not old.live and "not refreshed for 15 min" in old.why


def test_a_lease_of_another_node_with_this_host_name_is_judged_by_its_refresh_not_by_a_pid_here(tmp_path):
    """Bare-metal nodes installed from one image (or given one name: `docker --hostname`, cloned VMs) have the same
    host name, and the init pid namespace's id is the same on every host: a live reader's lease on the other node,
    judged by whether its pid runs HERE, was dead at once, and gc deleted the versions it was reading. A host is its
    kernel's boot id; a lease written before it was recorded is judged by its refresh age (never by a pid)."""
    mine = lease.Lease(tmp_path, "me").record()
    dead_here = 2**22 + 12345  # above pid_max: no process of this host has it
    now = time.time()
    for other in ({**mine, "boot_id": "another-node-s-kernel", "pid": dead_here},  # the same host name and namespace
                  {k: v for k, v in {**mine, "pid": dead_here}.items() if k != "boot_id"}):  # an older record
        assert lease.judge(tmp_path / "a.json", other, now - 60, now).live
        assert not lease.judge(tmp_path / "a.json", other, now - lease.STALE_SECONDS - 1, now).live
    assert not lease.judge(tmp_path / "a.json", {**mine, "pid": dead_here}, now, now).live  # this host's: asked


def test_a_remote_lease_is_refreshed_while_held(store, monkeypatch):
    two_versions(store)
    monkeypatch.setattr(lease, "REFRESH_SECONDS", 0.05)
    held = lease.hold(store.root, {"vae": 1}, "reader")
    two_min_ago = time.time() - 120  # as if last refreshed a while ago (past the margin: test_lease_lost)
    os.utime(held.path, (two_min_ago, two_min_ago))
    deadline = time.monotonic() + 120  # a bound for a loaded machine: the loop ends at the first refresh
    while held.path.stat().st_mtime < time.time() - 60 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert held.path.stat().st_mtime > time.time() - 60  # refreshed by the daemon thread
    held.release()


def test_a_read_only_store_reads_without_a_lease(store, monkeypatch, caplog):
    """On a read-only mount (simulated as in test_integrity: the tests run as root) no lease can be written:
    one warning, the versions are still resolved, and reading goes on."""

    two_versions(store)
    monkeypatch.setattr(os, "open", read_only_open(os.open))
    with caplog.at_level("WARNING", logger="store"):
        held = lease.hold(store.root, {"vae": None}, "a reader")
    assert held.path is None and held.versions == {"vae": [2]} and lease_files(store) == []
    assert "no read lease (Read-only file system)" in caplog.text
    assert held.add("vae", 1) is True  # nothing to register; the version is there
    held.release()
    assert store.reader("vae", held.version("vae")).keys()


INTERRUPTED_READER = """
import sys
from store import format as fmt, lease

write = fmt.atomic_write_bytes
def write_then_interrupted(path, data, *a, **k):  # the signal lands right after the lease file became visible
    write(path, data, *a, **k)
    raise KeyboardInterrupt
fmt.atomic_write_bytes = write_then_interrupted
try:
    lease.hold(sys.argv[1], {"vae": 1}, "an interrupted reader")
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_a_signal_while_the_lease_is_taken_leaves_no_lease(store):
    """SIGINT/SIGTERM between the lease file appearing and hold() returning: the process still removes it on
    its way out: a window test_signals can hit in a loaded run (it failed once so)."""
    two_versions(store)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", INTERRUPTED_READER, str(store.root)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.stdout.strip() == "interrupted", out.stderr
    assert lease_files(store) == []


def _state(pid: int) -> str:
    """The process's state letter (/proc/PID/stat field 3: R, S, Z, ...); "" once it is reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_a_reader_killed_and_not_yet_reaped_by_its_parent_does_not_keep_its_version(store):
    """kill -9 leaves a zombie until its parent waits for it (a launcher busy elsewhere or stopped): its pid still
    answers kill(pid, 0) with its own start time, but it reads nothing. It was judged running, and gc kept its
    version as long as the parent lived; reproduced with a real reader process, killed and not waited for."""
    two_versions(store)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", READER, str(store.root)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        path = Path(proc.stdout.readline().strip())
        proc.send_signal(signal.SIGKILL)  # not waited for (yet): a zombie
        deadline = time.monotonic() + 120  # a bound for a loaded machine: the loop ends once the kill has landed
        while _state(proc.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(proc.pid) == "Z"
        messages: list[str] = []
        p = gc.collect(store.root, echo=messages.append)
        assert [f.path for f in p.dead_leases] == [path] and not path.exists()
        assert any("not reaped" in m for m in messages), messages
        assert store.versions("vae") == [2]
    finally:
        proc.kill()
        proc.wait()


def test_a_lease_of_an_earlier_release_without_boot_id_is_judged_by_its_refresh_not_by_a_reused_pid(store):
    """An earlier release recorded no boot id. After a reboot its pid may be reused by an unrelated process that
    runs now: judged by that pid, the lease would block gc for ever. It is judged by its refresh age (the earlier
    release refreshed it too): kept while fresh, dead once not refreshed for STALE_SECONDS, whatever runs under
    its pid - reproduced with a real live process holding that pid."""
    two_versions(store)
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        mine = lease.Lease(store.root, "old").record()
        old = {k: v for k, v in mine.items() if k != "boot_id"}  # the earlier release's record
        old.update(pid=unrelated.pid, pid_start=lease._proc_start(unrelated.pid), versions={"vae": [1]},
                   what="a reader of an earlier release")
        path = store.root / lease.LEASES_DIR / f"{old['host']}-{unrelated.pid}-0ld0ld0l.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(old))
        messages: list[str] = []
        gc.collect(store.root, echo=messages.append)  # refreshed just now: kept (the reader may run on another host)
        assert store.versions("vae") == [1, 2] and path.exists()
        assert any("keep vae/v1" in m and "refreshed" in m for m in messages), messages
        long_ago = time.time() - lease.STALE_SECONDS - 60  # e.g. before the reboot
        os.utime(path, (long_ago, long_ago))
        gc.collect(store.root, echo=messages.append)
        assert store.versions("vae") == [2] and not path.exists()
        assert any("not refreshed for 16 min" in m for m in messages), messages
    finally:
        unrelated.kill()
        unrelated.wait()


def test_a_lease_record_whose_versions_are_damaged_is_one_line_not_a_traceback(store):
    """Valid JSON (an earlier release's unsealed record) whose `versions` a flipped byte made no version numbers
    ("1" -> "1\\x00"), of this very process: `store gc` stopped on int() with a traceback. Damaged: judged by its
    refresh age (store/test_lease_damaged.py): while fresh gc stops in one line, removing nothing; once stale its
    file is removed with one line, and gc goes on."""
    from schemas.errors import UserError
    from store.lease import LEASES_DIR, process_identity

    two_versions(store)
    folder = store.root / LEASES_DIR
    folder.mkdir(exist_ok=True)
    bad = folder / "host-1-damaged.json"
    bad.write_text(json.dumps({**process_identity(), "what": "a reader", "versions": {"vae": ["1\x00"]}}))
    with pytest.raises(UserError, match="is damaged .its versions are not table -> version numbers"):
        gc.collect(store.root, echo=lambda m: None)
    assert store.versions("vae") == [1, 2]
    long_ago = time.time() - lease.STALE_SECONDS - 60
    os.utime(bad, (long_ago, long_ago))
    messages: list[str] = []
    p = gc.collect(store.root, echo=messages.append)
    assert [f.path for f in p.dead_leases] == [bad] and not bad.exists()
    assert any("remove the lease of a gone reader" in m and "unreadable" in m for m in messages), messages
    assert store.versions("vae") == [2]


def test_gc_reads_each_versions_schema_once_however_many_leases_name_it(store, monkeypatch):
    """A lease per reading rank (64 on 8 nodes) names the same version: gc's plan read that version's schema.json,
    checked against its checksums.json (megabytes at 1M samples), once per lease. Once per version now."""
    two_versions(store)
    read: list[str] = []
    real = gc.checked_schema
    monkeypatch.setattr(gc, "checked_schema", lambda vdir, **kw: read.append(vdir.name) or real(vdir, **kw))
    held = [lease.hold(store.root, {"vae": 1}, f"rank {r}") for r in range(8)]
    try:
        p = gc.plan(store.root)
    finally:
        for one in held:
            one.release()
    assert sorted(p.leased) == [("vae", 1)] and len(p.leased[("vae", 1)]) == 8
    assert sorted(read) == ["v1", "v2"], read


def test_gc_of_a_url_reads_each_versions_schema_once_however_many_leases_name_it(store, tmp_path, monkeypatch):
    """As the local gc: 8 ranks of other nodes reading v1 of a URL (their lease objects, live by their refresh),
    and the plan checked v1's schema.json against its checksums.json 8 times. Once per version now."""
    from store import remote_gc
    from store.remote import open_remote
    from store.remote_push import push

    url = (tmp_path / "remote").as_uri()
    fill(store, 4)
    push(store.root, url)  # v1 while current
    fill(store, 4, tag="b", start=10)
    push(store.root, url)
    (tmp_path / "remote" / lease.LEASES_DIR).mkdir(exist_ok=True)
    for r in range(8):
        record = {"host": f"node-{r}", "boot_id": "another-kernel", "pid": 100 + r, "what": f"rank {r}",
                  "versions": {"vae": [1]}, "kind": "read"}
        (tmp_path / "remote" / lease.LEASES_DIR / f"node-{r}-100-ab.json").write_text(json.dumps(record))
    read: list[str] = []
    real = remote_gc.checked_schema
    monkeypatch.setattr(remote_gc, "checked_schema", lambda vdir, **kw: read.append(vdir.name) or real(vdir, **kw))
    p = remote_gc.plan(open_remote(url))
    assert sorted(p.leased) == [("vae", 1)] and len(p.leased[("vae", 1)]) == 8 and not p.remove
    assert sorted(read) == ["v1", "v2"], read


def test_a_new_lease_removes_the_dead_lease_files_of_its_host_it_meets(store):
    """A killed reader's lease file stayed in .leases/ until a `store gc`; a lease taken now removes this host's
    dead ones (one listing, under the store lock, through `lease.remove_dead`) and keeps every live one. Another
    host's, stale or not, is left to gc (its age: a stat per file per start on a shared file system)."""
    two_versions(store)
    live = lease.hold(store.root, {"vae": 1}, "a live reader")
    mine = live.record()
    dead_here = 2**22 + 12345  # above pid_max: no process of this host has it
    killed = store.root / lease.LEASES_DIR / f"{mine['host']}-{dead_here}-0badf00d.json"
    killed.write_bytes(lease.record_bytes({**mine, "pid": dead_here}))
    other = {**mine, "host": "another-host", "boot_id": "another-kernel", "pid": 7}
    stale = store.root / lease.LEASES_DIR / "another-host-7-0badcafe.json"
    stale.write_bytes(lease.record_bytes(other))
    long_ago = time.time() - lease.STALE_SECONDS - 120
    os.utime(stale, (long_ago, long_ago))
    fresh = store.root / lease.LEASES_DIR / "another-host-8-0badbeef.json"  # another host's, refreshed: live
    fresh.write_bytes(lease.record_bytes({**other, "pid": 8}))
    new = lease.hold(store.root, {"vae": 2}, "a new reader")
    try:
        assert set(lease_files(store)) == {live.path, stale, fresh, new.path}
        assert [f.path for f in gc.collect(store.root, echo=lambda m: None).dead_leases] == [stale]
        assert set(lease_files(store)) == {live.path, fresh, new.path}
    finally:
        new.release()
        live.release()


def test_a_new_lease_stats_no_other_hosts_lease_file(store, monkeypatch):
    """64 ranks' lease starts on a shared file system, one after the other under the store lock: each stat'ed
    every other host's lease file (a metadata round trip each: ~4,000 in all); now none."""
    fill(store, 6)
    first = lease.hold(store.root, {"vae": 1}, "a reader")
    mine = first.record()
    first.release()
    others = []
    for n in range(40):
        path = store.root / lease.LEASES_DIR / f"node{n}-{100 + n}-0badf00d.json"
        path.write_bytes(lease.record_bytes({**mine, "host": f"node{n}", "boot_id": f"kernel{n}", "pid": 100 + n}))
        others.append(path.name)
    stats: list[str] = []
    scandir, stat = os.scandir, os.stat

    class Entry:
        def __init__(self, entry):
            self.entry, self.name, self.path = entry, entry.name, entry.path

        def stat(self, **kw):
            stats.append(self.name)
            return self.entry.stat(**kw)

    class Listing:
        def __init__(self, path):
            self.listing = scandir(path)

        def __enter__(self):
            return (Entry(e) for e in self.listing.__enter__())

        def __exit__(self, *exc):
            return self.listing.__exit__(*exc)

    monkeypatch.setattr(os, "scandir", Listing)
    monkeypatch.setattr(os, "stat", lambda p, *a, **kw: stats.append(Path(p).name) or stat(p, *a, **kw))
    held = lease.hold(store.root, {"vae": 1}, "a new reader")
    held.release()
    assert not set(stats) & set(others), sorted(set(stats) & set(others))
