"""A damaged lease file (store/lease.py): sealed with its own CRC32C, so a flipped byte is damage, never read as
another pid (a live reader judged gone: its version removed under it) or another version (the one it reads left
unkept). A damaged lease is judged by its refresh age alone: while fresh, gc stops in one line, removing nothing;
its reader's heartbeat writes it again; once stale (its reader gone), gc removes it and goes on. A URL's lease
objects are sealed and read the same way."""

from __future__ import annotations

import json
import os
import time

import pytest

from schemas.errors import UserError
from store import Store
from store import gc, lease
from store import remote_lease
from store.remote import open_remote
from test_lease import two_versions


def _flip_pid(data: bytes, pid: int) -> bytes:
    """The lease's pid with its last digit changed: still valid JSON, another process's pid."""
    digit = str(pid)[-1]
    other = str((int(digit) + 1) % 10)
    return data.replace(f'"pid": {pid},'.encode(), f'"pid": {str(pid)[:-1] + other},'.encode())


def _damages(data: bytes, pid: int) -> dict[str, bytes]:
    return {"pid": _flip_pid(data, pid),
            "version": data.replace(b'"vae": [\n      1\n    ]', b'"vae": [\n      2\n    ]'),
            "truncated": data[: len(data) // 2]}


@pytest.mark.parametrize("how", ["pid", "version", "truncated"])
def test_a_damaged_lease_of_a_live_reader_stops_gc_in_one_line_and_keeps_its_version(store: Store, how) -> None:
    """Before: a flipped pid digit judged the live reader gone and a flipped version number kept v2 instead (valid
    JSON: both read as written), a truncated file counted as dead: gc removed v1 under the reader each time."""
    two_versions(store)
    held = lease.hold(store.root, {"vae": 1}, "a test reader")
    try:
        damaged = _damages(held.path.read_bytes(), os.getpid())[how]
        assert damaged != held.path.read_bytes()
        held.path.write_bytes(damaged)
        with pytest.raises(UserError, match=r"read lease .* is damaged .*stopped before removing anything more; "
                                            r"rerun") as e:
            gc.collect(store.root, echo=lambda m: None)
        assert "\n" not in str(e.value)
        assert store.versions("vae") == [1, 2] and held.path.read_bytes() == damaged
        assert held._beat() is True  # its heartbeat reads it back and writes it again
        assert lease.parse_record(held.path.read_bytes())[0]["versions"] == {"vae": [1]}
        p = gc.collect(store.root, echo=lambda m: None)
        assert ("vae", 1) in p.keep and store.versions("vae") == [1, 2]
    finally:
        held.release()


def test_a_damaged_lease_of_a_gone_reader_is_removed_once_stale(store: Store) -> None:
    """Its reader gone (no heartbeat): stale after the default margin, then removed with one line, and gc goes on."""
    two_versions(store)
    held = lease.hold(store.root, {"vae": 1}, "a test reader")
    path, data = held.path, held.path.read_bytes()
    held.release()
    path.write_bytes(_flip_pid(data, os.getpid()))
    long_ago = time.time() - lease.STALE_SECONDS - 60
    os.utime(path, (long_ago, long_ago))
    messages: list[str] = []
    p = gc.collect(store.root, echo=messages.append)
    assert [f.path for f in p.dead_leases] == [path] and not path.exists()
    assert any("remove the lease of a gone reader" in m and "checksum mismatch" in m for m in messages), messages
    assert store.versions("vae") == [2]


def test_an_earlier_releases_unsealed_lease_is_still_read(store: Store) -> None:
    two_versions(store)
    held = lease.hold(store.root, {"vae": 1}, "a test reader")
    try:
        record, damaged = lease.parse_record(held.path.read_bytes())
        assert damaged is None
        record.pop("checksum", None)
        held.path.write_text(json.dumps(record))  # what an earlier release wrote: plain JSON
        assert [f.live for f in lease.leases(store.root)] == [True]
        assert ("vae", 1) in gc.collect(store.root, dry_run=True, echo=lambda m: None).keep
    finally:
        held.release()


def test_a_damaged_lease_object_of_a_url_stops_its_gc_and_is_written_again(store: Store, tmp_path) -> None:
    """A URL's lease object: before, a flipped pid digit judged its live reader gone (its object removed, its
    version with it); now damage, and its next beat writes it whole again."""
    from store import remote_gc
    from store.remote_push import push

    url = (tmp_path / "remote").as_uri()
    two_versions(store)
    push(store.root, url)
    remote = open_remote(url)
    held = remote_lease.hold(remote, [("vae", 1)], "a test reader")
    try:
        obj = tmp_path / "remote" / held.rel
        obj.write_bytes(_flip_pid(obj.read_bytes(), os.getpid()))
        with pytest.raises(UserError, match=r"read lease .* is damaged"):
            remote_gc.plan(open_remote(url))
        assert held._beat() is True
        p = remote_gc.plan(open_remote(url))
        assert ("vae", 1) in p.leased and not p.remove
    finally:
        held.release()


def test_a_damaged_fresh_lease_in_a_url_cache_keeps_its_store_and_the_open_goes_on(store: Store, tmp_path,
                                                                                    caplog) -> None:
    """The URL cache's eviction is housekeeping: while a damaged lease in a cached store is fresh, an open with a
    size limit (a training reading the URL) stopped with the lease's line (up to 15 min for a gone reader's). It
    opens now, keeps every version of that store whole (the lease may name any; their shards may go, refetched on
    need, as a live lease's), and says so in one line, once per damaged file; once the lease is stale, the unused
    version goes."""
    from store import format as fmt
    from store.remote_cache import USAGE, local_store
    from store.remote_push import push
    from store_samples import fill

    url, cache = (tmp_path / "remote").as_uri(), tmp_path / "cache"
    fill(store, 8, tag="a")
    push(store.root, url)
    root = local_store(url, ["vae"], cache, whole=True, lease=False)  # v1 with its shards
    fill(store, 4, tag="b", start=50)
    push(store.root, url)
    local_store(url, ["vae"], cache, lease=False)  # v2 current, lazily: v1 read by nobody
    v1 = fmt.version_dir(root, "vae", 1)
    os.utime(v1, (1.0, 1.0))  # least recently used: the first to go whole
    held = lease.hold(root, {"vae": 1}, "a reader of the URL")
    path, data = held.path, held.path.read_bytes()
    held.release()
    path.write_bytes(_flip_pid(data, os.getpid()))  # its reader gone, its lease damaged, refreshed just now

    def a_kb_less() -> float:  # (more than the lease file: removed once dead, before the cache is counted)
        (cache / USAGE).unlink(missing_ok=True)
        return (sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock"))
                - 1000) / 1e9

    assert local_store(url, ["vae"], cache, lease=False) == root  # without a limit (it raised as well)
    with caplog.at_level("WARNING", logger="store"):
        for _ in range(2):
            assert local_store(url, ["vae"], cache, limit_gb=a_kb_less(), lease=False) == root
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0] and "\n" not in said[0], said
    assert fmt.is_complete(v1) and path.exists()

    # refreshed by its reader (os.utime, as a live reader does every few minutes): the same file, not said again
    # (it was said after each refresh, its mtime being part of the key)
    caplog.clear()
    with caplog.at_level("WARNING", logger="store"):
        for _ in range(2):
            os.utime(path)
            assert local_store(url, ["vae"], cache, limit_gb=1.0, lease=False) == root  # a walk, nothing evicted
    assert not [r for r in caplog.records if "is damaged" in r.getMessage()]

    # written whole again (a live lease: nothing said), then damaged again at the same path: said again, once (it
    # was said once per path and process: the second damage went unsaid)
    caplog.clear()
    path.write_bytes(data)
    assert local_store(url, ["vae"], cache, limit_gb=a_kb_less(), lease=False) == root
    path.write_bytes(_flip_pid(data, os.getpid()))
    with caplog.at_level("WARNING", logger="store"):
        for _ in range(2):
            assert local_store(url, ["vae"], cache, limit_gb=a_kb_less(), lease=False) == root
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0], said
    assert fmt.is_complete(v1) and path.exists()

    # rewritten atomically by its reader (a new file), damaged again, with no walk between: said again, once
    caplog.clear()
    fmt.atomic_write_bytes(path, _flip_pid(data, os.getpid()))
    with caplog.at_level("WARNING", logger="store"):
        for _ in range(2):
            assert local_store(url, ["vae"], cache, limit_gb=1.0, lease=False) == root
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0], said

    long_ago = time.time() - lease.STALE_SECONDS - 60  # its reader never wrote it again: stale, judged dead
    os.utime(path, (long_ago, long_ago))
    os.utime(v1, (1.0, 1.0))  # (its shards' eviction above touched it)
    local_store(url, ["vae"], cache, limit_gb=a_kb_less(), lease=False)
    assert not v1.exists() and not path.exists()


def _url_objects(scheme: str, request, tmp_path):
    """(a URL of that scheme, read(rel) -> bytes, write(rel, bytes)): its objects as a test damages them."""
    if scheme == "s3":
        s3 = request.getfixturevalue("s3_env")  # (a moto S3 server)
        client = s3.client()

        def read(rel: str) -> bytes:
            return client.get_object(Bucket=s3.bucket, Key=f"store/{rel}")["Body"].read()

        def write(rel: str, data: bytes) -> None:
            client.put_object(Bucket=s3.bucket, Key=f"store/{rel}", Body=data)

        return s3.url(), read, write
    folder = tmp_path / "remote"
    return folder.as_uri(), lambda rel: (folder / rel).read_bytes(), lambda rel, data: (folder / rel).write_bytes(data)


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_a_damaged_fresh_lease_object_at_a_url_pulls_every_version_and_its_gc_still_stops(store: Store, tmp_path,
                                                                                       caplog, request,
                                                                                       scheme) -> None:
    """Leaving out the URL's garbage is optional for a whole-URL pull: while a lease object there is damaged and
    fresh, the pull stopped with the gc's line (up to 15 min for a gone reader's). It copies every complete version
    now (the lease may name any: the safe side) and says so in one line; `store gc URL` still stops."""
    from store import remote_gc
    from store.remote_pull import pull
    from store.remote_push import push
    from store_samples import fill

    url, read, write = _url_objects(scheme, request, tmp_path)
    for i, tag in enumerate("ab"):  # the URL holds v1 (replaced: its gc's garbage) and v2 (current)
        fill(store, 3, tag=tag, start=10 * i)
        push(store.root, url)
    held = remote_lease.hold(open_remote(url), [("vae", 1)], "a test reader")
    rel = held.rel
    data = read(rel)
    held.release()  # its reader gone, its object left behind damaged, written just now
    write(rel, _flip_pid(data, os.getpid()))
    with caplog.at_level("WARNING", logger="store"):
        summary = pull(url, tmp_path / "copy")
    assert summary.copied == ["vae/v1", "vae/v2"] and summary.garbage == [], summary
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and rel in said[0] and "\n" not in said[0], said
    assert Store(tmp_path / "copy", create=False).versions("vae") == [1, 2]
    with pytest.raises(UserError, match=r"read lease .* is damaged .*stopped before removing anything more"):
        remote_gc.collect(url, echo=lambda m: None)
    assert "vae/v1/manifest.parquet" in open_remote(url).listing_times()  # gc removed nothing


def test_a_lease_damaged_while_a_urls_gc_removes_stops_it_in_words_that_stay_true(store: Store, tmp_path,
                                                                                  monkeypatch) -> None:
    """A URL's gc looks at the leases again before each version's DELETE: a lease object written damaged after the
    first version went stops it there. Its line said "this stopped before removing any" with v1 removed already;
    it says "anything more", and v2 is left whole."""
    from store import remote_gc
    from store.remote_push import push
    from store_samples import fill

    url = (tmp_path / "remote").as_uri()
    for i, tag in enumerate("abc"):  # v1 and v2 replaced by v3: the URL's gc removes both
        fill(store, 3, tag=tag, start=10 * i)
        push(store.root, url)
    looks, real = [], remote_gc._still_doomed

    def damaged_after_the_first(remote, v):
        if looks:  # v1 is removed: a reader's lease object arrives damaged, written just now
            held = remote_lease.hold(remote, [("vae", 3)], "a test reader")
            obj = tmp_path / "remote" / held.rel
            data = obj.read_bytes()
            held.release()
            obj.write_bytes(_flip_pid(data, os.getpid()))
        looks.append(v.name)
        return real(remote, v)

    monkeypatch.setattr(remote_gc, "_still_doomed", damaged_after_the_first)
    with pytest.raises(UserError, match=r"read lease .* is damaged .*stopped before removing anything more") as e:
        remote_gc.collect(url, echo=lambda m: None)
    assert "\n" not in str(e.value) and looks == ["vae/v1", "vae/v2"], looks
    listed = open_remote(url).listing_times()
    assert "vae/v1/manifest.parquet" not in listed and "vae/v2/manifest.parquet" in listed


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_a_damaged_fresh_local_lease_pushes_every_version_and_gc_still_stops(store: Store, tmp_path, caplog,
                                                                            request, scheme) -> None:
    """Leaving out the local store's garbage is optional for push: while a local lease file is damaged and fresh,
    push stopped with the gc's line (its keep rule asked the lease's versions; up to 15 min for a gone reader's). It
    sends every complete version now (the lease may name any: the safe side) and says so in one line; `store gc`
    still stops."""
    from store.remote_pull import pull
    from store.remote_push import push

    url, _, _ = _url_objects(scheme, request, tmp_path)
    two_versions(store)  # v1 replaced by v2: the local gc's garbage
    held = lease.hold(store.root, {"vae": 1}, "a test reader")
    path, data = held.path, held.path.read_bytes()
    held.release()  # its reader gone, its file left behind damaged, written just now
    path.write_bytes(_flip_pid(data, os.getpid()))
    with caplog.at_level("WARNING", logger="store"):
        summary = push(store.root, url)
    assert summary.copied == ["vae/v1", "vae/v2"] and summary.garbage == [], summary
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and str(path) in said[0] and url in said[0] and "\n" not in said[0], said
    assert pull(url, tmp_path / "copy", every_version=True).copied == ["vae/v1", "vae/v2"]  # both there, whole
    assert Store(tmp_path / "copy", create=False).versions("vae") == [1, 2]
    with pytest.raises(UserError, match=r"read lease .* is damaged .*stopped before removing anything more"):
        gc.collect(store.root, echo=lambda m: None)
    assert store.versions("vae") == [1, 2] and path.exists()  # gc removed nothing
