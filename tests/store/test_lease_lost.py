"""A reader paused past its lease's margin (SIGSTOP, a suspended VM, a hung mount) may have had its lease judged
dead, and its version removed, by a `store gc` elsewhere. A local lease (looked at under the store lock, which gc
holds throughout) is lost iff a version it names is gone: then it is never written again and the reader stops at
its next read with one line instead of reading on from a version whose files may be gone (store/lease.lose,
check_held); removed with every version kept, it is written again and the reader goes on. A URL lease (no lock)
removed is always lost (before: it was silently recreated). Ages come from the `now=` hooks and file mtimes, never
from waiting."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from store import Store
from store import format as fmt
from store import gc, lease, remote_lease
from store import remote as remote_mod
from store.remote import open_remote
from store.remote_push import push
from store_samples import fill

AGED = lease.STALE_SECONDS + 120  # older than gc's margin


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _paused_past_the_margin(held: lease.Lease) -> None:
    long_ago = time.time() - AGED  # its refreshes stopped this long ago
    os.utime(held.path, (long_ago, long_ago))


def _gc_on_another_host(store: Store, monkeypatch) -> list[str]:
    """A real `store gc` run from another host of a shared file system: it judges this process's leases by their
    refresh age (it cannot ask our pid), removes the dead ones' files and every version no live lease names."""
    messages: list[str] = []
    with monkeypatch.context() as m:
        m.setattr(lease, "host_id", lambda: "another-node-s-kernel")
        gc.collect(store.root, echo=messages.append)
    return messages


def _taken_by_gc(store: Store, version: int) -> None:
    """What gc does to a version no live lease names (gc.collect: renamed out of the versions, then deleted)."""
    vdir = fmt.version_dir(store.root, "vae", version)
    gone = vdir.with_name(f".{vdir.name}.gc-deleting")
    os.rename(vdir, gone)
    shutil.rmtree(gone)


def _lease_objects(s3_env) -> list[str]:
    out = s3_env.client().list_objects_v2(Bucket=s3_env.bucket).get("Contents", [])
    return [o["Key"] for o in out if "/.leases/" in o["Key"]]


@pytest.fixture
def two_versions(store: Store) -> Store:
    """v1 and v2 (current) of 4 samples each: v1 is what a gc may take."""
    fill(store, 4, tag="a")  # v1
    fill(store, 4, tag="b", start=10)  # v2 current
    return store


@pytest.fixture
def v1_reader(two_versions: Store):
    """A reader of v1 under its lease: (the lease, a read of one of its samples); released and closed after."""
    held = lease.hold(two_versions.root, {"vae": 1}, "a reader")
    reader = two_versions.reader("vae", 1)
    key = sorted(reader.keys())[0]
    yield held, lambda: reader.tensors(key)
    held.release()
    reader.close()


def _lost_for_good(held: lease.Lease, read, match: str, other_version: int) -> None:
    """Lost: never written again, by a beat or an add, and the reader's next read stops with one line."""
    assert held._beat() is False and not held.path.exists()
    with pytest.raises(lease.LeaseLost, match=match):
        read()
    with pytest.raises(lease.LeaseLost):
        held.add("vae", other_version)
    assert not held.path.exists()


# A reader of a URL on "another node" (its lease judged by refresh age, as gc on another host judges it), every
# shard of v1 in its cache: it could read on for ever from there. Its heartbeat beats every 0.2 s.
PAUSED_READER = """
import sys, time
from pathlib import Path
from schemas.errors import UserError
from store import Store, lease, remote_lease
from store.remote_cache import local_store

lease.host_id = lambda: "another-node-s-kernel"
remote_lease.REFRESH_SECONDS = 0.2
reader = Store(local_store(sys.argv[1], ["vae"], Path(sys.argv[2]), whole=True), create=False).reader("vae")
keys = sorted(reader.keys())
print("reading", flush=True)
sys.stdin.readline()  # paused (SIGSTOP), collected, resumed meanwhile
deadline = time.monotonic() + 120  # a bound for a loaded machine: the loop ends at the first read after the beat
try:
    while time.monotonic() < deadline:
        for k in keys:
            reader.tensors(k)
        time.sleep(0.05)
    print("read on", flush=True)
except UserError as e:
    print("stopped:", e, flush=True)
"""


def test_a_url_reader_paused_while_gc_took_its_version_stops_and_never_rewrites_its_lease(
        s3_env, store: Store, tmp_path: Path, monkeypatch) -> None:
    from store.remote_gc import collect

    fill(store, 6, tag="a")  # v1
    push(store.root, s3_env.url())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_READER, s3_env.url(), str(tmp_path / "cache")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "reading"
        assert len(_lease_objects(s3_env)) == 1
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 120  # a bound for a loaded machine: ends once the stop has landed
        while _state(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(proc.pid) == "T"
        fill(store, 6, tag="b", start=10)  # v2 current
        push(store.root, s3_env.url())
        # gc 16 min later by the server's clock: the stopped reader's lease is stale, v1 and the lease go
        real_now = remote_mod.Remote.now
        monkeypatch.setattr(remote_mod.Remote, "now", lambda self: real_now(self) + AGED)
        messages: list[str] = []
        collect(s3_env.url(), echo=messages.append)
        monkeypatch.setattr(remote_mod.Remote, "now", real_now)
        assert any(m.startswith("remove vae/v1") for m in messages), messages
        assert _lease_objects(s3_env) == []
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        said = proc.stdout.read()
        proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    assert said.startswith("stopped: the read lease of this"), said
    assert "was removed" in said and "vae v1" in said and "Rerun" in said and lease.LEASE_MINUTES_ENV in said, said
    assert _lease_objects(s3_env) == []  # never written again


def test_a_url_lease_found_older_than_the_margin_is_lost_once_a_version_it_names_lost_its_manifest(
        s3_env, store: Store, monkeypatch) -> None:
    """Stale but still there: a gc may be removing what it names right now. Refreshed (gc's look before each DELETE
    keeps it from then on) and then checked: intact, the reader goes on (paused on a host where no gc judged it);
    a manifest gone (what gc deletes first), it is lost and never written again."""
    fill(store, 4)
    push(store.root, s3_env.url())
    held = remote_lease.hold(open_remote(s3_env.url()), [("vae", 1)], "pipeline train")
    try:
        assert held._beat() is True  # fresh: refreshed (conditionally, on S3)
        assert held._beat(now=held.remote.now() + AGED) is True  # stale, v1 intact: refreshed
        lease.check_held()
        s3_env.client().delete_object(Bucket=s3_env.bucket, Key="store/vae/v1/manifest.parquet")  # a gc, midway
        assert held._beat(now=held.remote.now() + AGED) is False
        with pytest.raises(lease.LeaseLost, match="was not refreshed for 17 min and vae v1 is gone"):
            lease.check_held()
        writes: list[str] = []
        real_pipe = held.remote.fs.pipe_file  # fsspec sets its sync methods on the instance
        monkeypatch.setattr(held.remote.fs, "pipe_file",
                            lambda path, *a, **k: writes.append(path) or real_pipe(path, *a, **k))
        with pytest.raises(lease.LeaseLost):
            held.add([("vae", 2)])
        assert writes == []  # never written again
    finally:
        held.release()
    lease.check_held()  # released: a process that goes on reads again
    assert _lease_objects(s3_env) == []


def test_a_shared_file_system_lease_removed_with_its_version_is_lost_and_a_stale_one_refreshed_only_while_intact(
        store: Store, v1_reader) -> None:
    held, read = v1_reader
    assert held._beat() is True
    _paused_past_the_margin(held)  # no gc judged it (it is still there)
    long_ago = held.path.stat().st_mtime
    assert held._beat() is True and held.path.stat().st_mtime > long_ago  # v1 intact: refreshed
    assert read()
    held.path.unlink()  # a gc on another host judged it dead
    _taken_by_gc(store, 1)  # and took v1
    _lost_for_good(held, read, "a reader on .* was removed .* and vae v1 is gone.*vae v1.*Rerun", 2)
    held.release()
    lease.check_held()  # released: the process reads on without it


@pytest.mark.usefixtures("two_versions")
def test_a_lease_gc_removed_while_paused_is_written_again_when_gc_kept_every_version_it_names(
        store: Store, monkeypatch, caplog) -> None:
    """Paused past its margin, the reader's lease was judged dead by a gc on another host and its file removed, but
    that gc kept what it names: v2 is current, v1 another reader's live lease holds. Before, waking always stopped
    the reader ("was removed"); under the store lock no gc is midway, so the lease is written again and it reads
    on - and the next gc keeps v1 for it."""
    held = lease.hold(store.root, {"vae": None}, "a reader")
    assert held.add("vae", 1)
    other = lease.hold(store.root, {"vae": 1}, "another reader")  # refreshed lately: live for any gc
    old, new = store.reader("vae", 1), store.reader("vae")
    try:
        _paused_past_the_margin(held)
        messages = _gc_on_another_host(store, monkeypatch)
        assert any(m.startswith("remove the lease of a gone reader: a reader (") for m in messages), messages
        assert not held.path.exists()
        assert fmt.is_complete(fmt.version_dir(store.root, "vae", 1))
        with caplog.at_level("WARNING", logger="store"):
            assert held._beat() is True
        assert json.loads(held.path.read_text())["versions"] == {"vae": [2, 1]}  # written again
        assert held.path.stat().st_mtime > time.time() - 60
        warned = [r.getMessage() for r in caplog.records if "was removed by a `store gc`" in r.getMessage()]
        assert len(warned) == 1 and "paused" in warned[0] and "vae v2, vae v1" in warned[0], caplog.text
        assert old.tensors(sorted(old.keys())[0]) and new.tensors(sorted(new.keys())[0])  # no LeaseLost
        lease.check_held()
        other.release()
        messages = _gc_on_another_host(store, monkeypatch)  # its lease is live again: v1 kept for it alone
        assert any(m.startswith("keep vae/v1: not current, but read by a reader (") for m in messages), messages
        assert held.path.exists() and held._beat() is True
    finally:
        held.release()
        other.release()
        old.close()
        new.close()
    lease.check_held()


def test_a_lease_gc_removed_while_paused_with_a_version_it_names_is_lost_and_never_written_again(
        store: Store, v1_reader, monkeypatch) -> None:
    held, read = v1_reader
    _paused_past_the_margin(held)
    messages = _gc_on_another_host(store, monkeypatch)
    assert "remove vae/v1" in messages and not held.path.exists(), messages
    _lost_for_good(held, read, r"a reader on .* was removed \(.*\) and vae v1 is gone.*Rerun", 2)
    held.release()
    lease.check_held()


@pytest.mark.usefixtures("two_versions")
def test_a_lease_whose_version_gc_took_and_a_writer_numbered_again_is_lost_not_written_again(
        store: Store, monkeypatch) -> None:
    """A writer numbers a new version one past the newest folder left (store/writer_open.candidate_version), so
    once gc took v2 the next write is another v2. Settings A give v1, B v2 (read by a training on another host,
    paused past its margin), A again makes v1 current; gc takes v2 and the lease; settings C commit a new v2.
    Before, the woken reader found "vae v2" complete, wrote its lease again and read on from the new v2's files
    under the old manifest's offsets."""
    held = lease.hold(store.root, {"vae": None}, "a training")
    reader = store.reader("vae")
    key = sorted(reader.keys())[0]
    try:
        assert held.versions == {"vae": [2]}
        store.set_current("vae", 1)  # settings A again: v1 reused
        _paused_past_the_margin(held)
        messages = _gc_on_another_host(store, monkeypatch)
        assert "remove vae/v2" in messages and not held.path.exists(), messages
        assert fill(store, 6, tag="c", start=20) == 2  # a different v2, by a real writer
        assert fmt.is_complete(fmt.version_dir(store.root, "vae", 2))
        _lost_for_good(held, lambda: reader.tensors(key), r"a training on .* was removed \(.*\) and vae v2 \(a new "
                                                          r"version of that number since\) is gone.*Rerun", 1)
    finally:
        held.release()
        reader.close()
    lease.check_held()


def test_a_lease_lost_on_one_store_stops_the_reads_of_that_store_only(store: Store, v1_reader,
                                                                     tmp_path: Path) -> None:
    """A lease the process left unreleased (a failed command whose traceback a caller keeps, in-process: run all,
    the tests) and lost since stopped every later read of the process, of any store (before: a CI worker's
    later tests of other stores all failed on it)."""
    held, read = v1_reader
    other = Store(tmp_path / "other")
    fill(other, 4)
    with other.reader("vae") as theirs:
        held.path.unlink()
        _taken_by_gc(store, 1)
        assert held._beat() is False
        with pytest.raises(lease.LeaseLost, match="a reader on .* was removed"):
            read()
        assert theirs.tensors(sorted(theirs.keys())[0])  # another store: read on


@pytest.mark.usefixtures("two_versions")
def test_a_lease_removed_while_paused_is_lost_when_its_reader_adds_a_version_before_the_heartbeat_wakes(
        store: Store) -> None:
    """The main thread may add a version right after waking, before the heartbeat looks: the add looks as the
    heartbeat does (before: it wrote the removed lease back, fresh, naming a version gc had taken, and the
    heartbeat never marked it lost)."""
    held = lease.hold(store.root, {"vae": 1}, "a reader")
    try:
        held.path.unlink()  # a gc on another host judged it dead
        _taken_by_gc(store, 1)
        with pytest.raises(lease.LeaseLost, match="a reader on .* was removed .* and vae v1 is gone.*Rerun"):
            held.add("vae", 2)
        assert not held.path.exists()  # never written again
        assert held.versions == {"vae": [1]}
        assert held._beat() is False
    finally:
        held.release()
    lease.check_held()


@pytest.mark.usefixtures("two_versions")
def test_a_lease_removed_while_paused_with_its_versions_kept_is_written_again_by_an_add(store: Store) -> None:
    held = lease.hold(store.root, {"vae": 1}, "a reader")
    try:
        held.path.unlink()  # a gc on another host judged it dead, but kept v1
        assert held.add("vae", 2) is True
        assert json.loads(held.path.read_text())["versions"] == {"vae": [1, 2]}
        assert held._beat() is True
        lease.check_held()
    finally:
        held.release()
    assert list((store.root / lease.LEASES_DIR).glob("*.json")) == []  # released: removed


@pytest.mark.usefixtures("two_versions")
def test_a_url_lease_removed_while_paused_is_lost_when_its_reader_adds_a_version(s3_env, store: Store) -> None:
    push(store.root, s3_env.url())
    held = remote_lease.hold(open_remote(s3_env.url()), [("vae", 1)], "pipeline train")
    try:
        s3_env.client().delete_object(Bucket=s3_env.bucket, Key=_lease_objects(s3_env)[0])  # a gc judged it dead
        with pytest.raises(lease.LeaseLost, match="pipeline train on .* was removed .*vae v1\\).*Rerun"):
            held.add([("vae", 2)])
        assert _lease_objects(s3_env) == []  # never written again
        assert held._beat() is False
    finally:
        held.release()
    lease.check_held()


def test_a_server_refusing_conditional_puts_still_gets_its_url_leases_refreshed(
        s3_env, store: Store, monkeypatch, caplog) -> None:
    """A server without If-Match on PUT (an error other than 412 / 404): before, the lease was never refreshed
    again, and 15 min later a gc elsewhere removed what this live reader reads."""
    fill(store, 4)
    push(store.root, s3_env.url())
    held = remote_lease.hold(open_remote(s3_env.url()), [("vae", 1)], "pipeline train")
    plain: list[str] = []
    real_pipe = held.remote.fs.pipe_file  # fsspec sets its sync methods on the instance

    def no_if_match(path, *a, **k):
        if "IfMatch" in k:
            raise OSError("An error occurred (NotImplemented) when calling the PutObject operation: "
                          "A header you provided implies functionality that is not implemented")
        plain.append(path)
        return real_pipe(path, *a, **k)

    monkeypatch.setattr(held.remote.fs, "pipe_file", no_if_match)
    try:
        with caplog.at_level("WARNING", logger="store"):
            assert held._beat() is True and held._beat() is True
        assert [w for w in plain if "/.leases/" in w] == [held.remote.path(held.rel)] * 2  # refreshed, each beat
        assert sum("refused the conditional rewrite" in r.getMessage() for r in caplog.records) == 1, caplog.text
        s3_env.client().delete_object(Bucket=s3_env.bucket, Key=_lease_objects(s3_env)[0])
        assert held._beat() is False  # the look before the plain PUT still finds it removed
        assert _lease_objects(s3_env) == []
        with pytest.raises(lease.LeaseLost, match="was removed"):
            lease.check_held()
    finally:
        held.release()


def test_a_lease_records_a_longer_margin_that_gc_honours(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(lease.LEASE_MINUTES_ENV, "120")
    record = {**lease.Lease(tmp_path, "me").record(), "boot_id": "another-node-s-kernel"}
    assert record["stale_s"] == 7200
    now = time.time()
    assert lease.judge(tmp_path / "a.json", record, now - AGED, now).live  # 17 min: live under its 2 h
    assert not lease.judge(tmp_path / "a.json", record, now - 7300, now).live
    monkeypatch.setenv(lease.LEASE_MINUTES_ENV, "1")  # never below the default margin
    assert lease.stale_seconds() == lease.STALE_SECONDS
    monkeypatch.setenv(lease.LEASE_MINUTES_ENV, "soon")
    with pytest.raises(lease.UserError, match="PIPELINE_LEASE_MINUTES='soon' is not a number"):
        lease.stale_seconds()


@pytest.mark.usefixtures("two_versions")
def test_a_lease_keeps_the_margin_it_was_held_with_whatever_the_environment_says_later(
        s3_env, store: Store, monkeypatch, caplog) -> None:
    """The margin (`stale_s`) is decided when a lease is held. Before, every beat and look read
    PIPELINE_LEASE_MINUTES again: lowered later, a lease was rewritten recording 15 min (gc then judged it by that)
    and lost at 17 min although held for 120; set to a bad value, the heartbeat raised in its thread."""
    push(store.root, s3_env.url())
    monkeypatch.setenv(lease.LEASE_MINUTES_ENV, "120")
    local = lease.hold(store.root, {"vae": 1}, "a reader")
    url = remote_lease.hold(open_remote(s3_env.url()), [("vae", 1)], "pipeline train")
    try:
        monkeypatch.setenv(lease.LEASE_MINUTES_ENV, "1")  # lowered mid-run (to the 15 min floor)
        assert local.add("vae", 2)  # rewritten: still its own margin
        assert json.loads(local.path.read_text())["stale_s"] == 7200 == local.record()["stale_s"]
        assert url._beat(now=url.remote.now() + AGED) is True  # 17 min: within its 120
        assert json.loads(url.remote.read(url.rel))["stale_s"] == 7200
        monkeypatch.setenv(lease.LEASE_MINUTES_ENV, "soon")  # a bad value set later
        long_ago = time.time() - AGED
        os.utime(local.path, (long_ago, long_ago))
        with caplog.at_level("WARNING", logger="store"):
            assert local._beat() is True and local.path.stat().st_mtime > long_ago  # refreshed, no UserError
            s3_env.client().delete_object(Bucket=s3_env.bucket, Key="store/vae/v1/manifest.parquet")
            assert url._beat(now=url.remote.now() + AGED) is True  # 17 min, a version gone: still within 120
        assert "could not refresh" not in caplog.text, caplog.text
        lease.check_held()
        s3_env.client().delete_object(Bucket=s3_env.bucket, Key=_lease_objects(s3_env)[0])
        assert url._beat() is False
        with pytest.raises(lease.LeaseLost, match=r"outlives its last refresh \(120 min\)"):
            lease.check_held(url)
    finally:
        local.release()
        url.release()


def test_a_url_lease_lost_stops_the_reads_of_its_cached_store_only(s3_env, store: Store, tmp_path: Path) -> None:
    """Before, a lost URL lease stopped every read of the process, of any store (a local lease stops only its
    store's: test_a_lease_lost_on_one_store_stops_the_reads_of_that_store_only)."""
    from store.remote_cache import local_store

    fill(store, 4)
    push(store.root, s3_env.url())
    cached = Store(local_store(s3_env.url(), ["vae"], tmp_path / "cache", whole=True), create=False)
    mine, theirs = cached.reader("vae"), store.reader("vae")
    held = remote_lease._held[s3_env.url()]
    try:
        s3_env.client().delete_object(Bucket=s3_env.bucket, Key=_lease_objects(s3_env)[0])  # a gc judged it dead
        assert held._beat() is False
        with pytest.raises(lease.LeaseLost, match="was removed .*vae v1.*Rerun"):
            mine.tensors(sorted(mine.keys())[0])
        assert theirs.tensors(sorted(theirs.keys())[0])  # another store: read on
    finally:
        remote_lease.release_reading(s3_env.url())
        mine.close()
        theirs.close()
    lease.check_held()


def test_gc_keeps_a_dead_lease_its_reader_refreshed_after_the_plan(s3_env, store: Store, monkeypatch) -> None:
    """A reader paused past its margin (its lease judged dead in gc's plan) wakes before gc deletes the dead leases
    and refreshes its lease (what it names is current, kept). Before, gc deleted it anyway: the reader's next beat
    found it removed and stopped it."""
    from store import remote_gc

    fill(store, 4)
    push(store.root, s3_env.url())
    real_identity = lease.process_identity  # as on another node: judged by its refresh age
    monkeypatch.setattr(lease, "process_identity", lambda: {**real_identity(), "boot_id": "another-node-s-kernel"})
    held = remote_lease.hold(open_remote(s3_env.url()), [("vae", 1)], "pipeline train")
    real_now, real_plan = remote_mod.Remote.now, remote_gc.plan

    def paused_then_woken(remote, *a, **k):
        monkeypatch.setattr(remote_mod.Remote, "now", lambda self: real_now(self) + AGED)  # paused past its margin
        p = real_plan(remote, *a, **k)
        monkeypatch.setattr(remote_mod.Remote, "now", real_now)
        assert [f.record.get("what") for f in p.dead_leases] == ["pipeline train"]
        assert held._beat() is True  # it wakes: v1 is intact, its lease refreshed
        return p

    monkeypatch.setattr(remote_gc, "plan", paused_then_woken)
    messages: list[str] = []
    try:
        remote_gc.collect(s3_env.url(), echo=messages.append)
        assert [k.split("/", 1)[1] for k in _lease_objects(s3_env)] == [held.rel]
        assert any(m.startswith("keep the lease of pipeline train") for m in messages), messages
        assert held._beat() is True
        lease.check_held()
    finally:
        held.release()


def _woken_during_gc(s3_env, store: Store, monkeypatch, step: str):
    """A reader of v1 paused past its margin (its lease dead in gc's plan) wakes during gc at `step` - "look": right
    after gc's look before v1's manifest DELETE (`_still_doomed`); "relist": right after gc's look for leases after
    that DELETE (`_leased_by(since=...)`) - finds v1's manifest (still there, or in its cache) and rewrites its
    lease. (the lease, gc's messages)."""
    from store import remote_gc

    here = lease.hold(store.root, {"vae": 1}, "a reader here")  # v1 pushed too: a superseded version alone is not
    try:
        push(store.root, s3_env.url())
    finally:
        here.release()
    real_identity = lease.process_identity  # as on another node: judged by its refresh age
    monkeypatch.setattr(lease, "process_identity", lambda: {**real_identity(), "boot_id": "another-node-s-kernel"})
    held = remote_lease.hold(open_remote(s3_env.url()), [("vae", 1)], "pipeline train")
    real_now, real_doomed, real_leased = remote_mod.Remote.now, remote_gc._still_doomed, remote_gc._leased_by
    monkeypatch.setattr(remote_mod.Remote, "now", lambda self: real_now(self) + AGED)  # paused past its margin
    woke: list[bool] = []

    def wake() -> None:
        monkeypatch.setattr(remote_mod.Remote, "now", real_now)
        # old; at "look" v1's manifest is there (rewritten, reads on); at "relist" it is gone but the rewrite came
        # first (the If-Match PUT, then the look at the manifests): a reader that looked just before the DELETE
        woke.append(held._beat(now=real_now(held.remote) + AGED) if step == "look" else held._write_over(
            held.remote.path(held.rel), None) is None)
        lease.check_held(held)

    def after_the_look(remote, v):
        keepers = real_doomed(remote, v)  # the lease still looks dead: v1 is doomed
        wake()
        return keepers

    def after_the_relist(remote, v, since=None):
        found = real_leased(remote, v, since)
        if since is not None:
            wake()
        return found

    if step == "look":
        monkeypatch.setattr(remote_gc, "_still_doomed", after_the_look)
    else:
        monkeypatch.setattr(remote_gc, "_leased_by", after_the_relist)
    messages: list[str] = []
    remote_gc.collect(s3_env.url(), echo=messages.append)
    assert woke == [True]
    return held, messages


@pytest.mark.usefixtures("two_versions")
def test_a_reader_woken_after_gc_looked_reads_on_from_the_data_gc_holds_back(s3_env, store: Store,
                                                                           monkeypatch) -> None:
    """Its lease is listed after v1's manifest DELETE: v1's data stays while the lease names it, and the lease is
    kept. Before, gc deleted v1 and then either kept the lease (the reader read on from cached shards and failed
    on the first uncached one with a fetch error) or, later, deleted it (the reader stopped though it had checked
    v1 intact)."""
    held, messages = _woken_during_gc(s3_env, store, monkeypatch, "look")
    try:
        assert "remove vae/v1" in messages, messages
        assert any(m.startswith("keep the data of vae/v1") for m in messages), messages
        v1 = s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix="store/vae/v1/").get("Contents", [])
        v1 = [o["Key"].rsplit("/", 1)[1] for o in v1]
        assert v1 and fmt.MANIFEST not in v1 and any(n.endswith(".tar") for n in v1)
        assert _lease_objects(s3_env) == [f"store/{held.rel}"]  # kept: refreshed, and what it names is intact
        assert held._beat() is True
        lease.check_held(held)
    finally:
        held.release()
    lease.check_held()


@pytest.mark.usefixtures("two_versions")
def test_gc_removes_a_refreshed_lease_that_names_a_version_it_removed_and_its_reader_stops(
        s3_env, store: Store, monkeypatch) -> None:
    """The reader woke after gc's last look for leases naming v1 (after its manifest DELETE): gc deleted v1's data,
    and the lease goes with it, so the reader's next beat stops it in one line. Kept as refreshed (as before), its
    beats never looked at v1 again: it read on from cached shards of a deleted version and failed on the first
    uncached one with a fetch error."""
    held, messages = _woken_during_gc(s3_env, store, monkeypatch, "relist")
    try:
        assert "remove vae/v1" in messages, messages
        assert s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix="store/vae/v1/").get("KeyCount") == 0
        assert _lease_objects(s3_env) == []  # refreshed, but it names v1: removed with it
        assert any(m.startswith("remove the lease of pipeline train") and "vae/v1 is removed" in m
                   for m in messages), messages
        assert held._beat() is False  # the next beat: removed, never written again
        assert _lease_objects(s3_env) == []
        with pytest.raises(lease.LeaseLost, match=r"pipeline train on .* was removed .*vae v1.*Rerun"):
            lease.check_held(held)
    finally:
        held.release()
    lease.check_held()
