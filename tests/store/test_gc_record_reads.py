"""The keep rule (store/gc.py `keep_rule`, store/remote_gc.py `keep_rule`) asked by pull, push and the cache reads
each record once: a whole-URL pull GETs the URL's store.json once (its gc's `not_kept` took the entries the pull
read, where it fetched them again), a local store's complete versions are listed once for `not_kept` (each a stat
of its manifest; it listed them again inside `keep_rule`), and push and the cache's look for replaced versions
read the local store.json once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from store import Store, gc
from store import format as fmt
from store.remote import Remote
from store.remote_pull import pull
from store.remote_push import push
from store_samples import fill


def _store_json_gets(monkeypatch) -> Counter:
    gets: Counter[str] = Counter()
    real = Remote.read

    def counted(self, rel, *args, **kwargs):
        gets[rel] += 1
        return real(self, rel, *args, **kwargs)

    monkeypatch.setattr(Remote, "read", counted)
    return gets


def _replaced_twice(store: Store, url: str) -> None:
    """The URL holds vae v1, v2 and v3 (current): v1 and v2 are garbage there, so its keep rule is asked."""
    for i, tag in enumerate("abc"):
        fill(store, 3, tag=tag, start=10 * i)
        push(store.root, url)


def test_a_whole_url_pull_reads_store_json_once(store: Store, tmp_path: Path, monkeypatch) -> None:
    url = (tmp_path / "remote").as_uri()
    _replaced_twice(store, url)
    gets = _store_json_gets(monkeypatch)
    summary = pull(url, tmp_path / "copy")
    assert summary.copied == ["vae/v3"] and summary.garbage == ["vae/v1", "vae/v2"], summary
    assert gets[fmt.STORE_JSON] == 1, gets


def test_not_kept_lists_the_complete_versions_once(store: Store, monkeypatch) -> None:
    for i, tag in enumerate("ab"):  # v1 replaced by v2: the keep rule is asked
        fill(store, 3, tag=tag, start=10 * i)
    listings, stats, records = [], [], []
    real_every, real_complete, real_record = gc._every_version, gc._complete_versions, fmt.read_store_record
    monkeypatch.setattr(gc, "_every_version", lambda root: listings.append(root) or real_every(root))
    monkeypatch.setattr(gc, "_complete_versions", lambda root, every: stats.append(root) or real_complete(root, every))
    monkeypatch.setattr(fmt, "read_store_record", lambda root: records.append(root) or real_record(root))
    assert gc.not_kept(store.root) == ({("vae", 1)}, [])
    assert len(listings) == 1 and len(stats) == 1 and len(records) == 1, (listings, stats, records)


def test_the_caches_look_for_replaced_versions_reads_store_json_once(store: Store, monkeypatch) -> None:
    from store import lease
    from store.remote_cache import _not_kept_here
    from store.remote_shards import mark

    for i, tag in enumerate("ab"):
        fill(store, 3, tag=tag, start=10 * i)
    mark(store.version_dir("vae", 2), "s3://b/s", "vae", 2, pushed_here=True)  # the cache's writer moved past v1
    records = []
    real_record = fmt.read_store_record
    monkeypatch.setattr(fmt, "read_store_record", lambda root: records.append(root) or real_record(root))
    assert _not_kept_here(store.root, lease.leases(store.root)) == {("vae", 1)}
    assert len(records) == 1, records


def test_a_working_copy_reads_store_json_once_for_its_pull(store: Store, tmp_path: Path, monkeypatch) -> None:
    """store/remote_work.py `work_copy` reads the URL's store.json (its tables, the record of where the copy was
    begun), then pulls those tables: the pull takes that record, not a GET of its own (the lazy open of the other
    versions after it reads its own, as every open does)."""
    from store import remote_shards
    from store.remote_work import work_copy

    url = (tmp_path / "remote").as_uri()
    _replaced_twice(store, url)
    monkeypatch.setattr(remote_shards, "open_lazily", lambda *a, **k: set())  # its own read, not this one's
    gets = _store_json_gets(monkeypatch)
    root = work_copy(url, tmp_path / "cache")
    assert Store(root, create=False).tables() == {"vae": 3}
    assert gets[fmt.STORE_JSON] == 1, gets


def test_a_push_reads_the_local_store_json_once(store: Store, tmp_path: Path, monkeypatch) -> None:
    """push read it, then again for its versions and a third time for its gc's `not_kept`."""
    for i, tag in enumerate("ab"):  # v1 replaced by v2: not sent
        fill(store, 3, tag=tag, start=10 * i)
    records = []
    real_record = fmt.read_store_record
    monkeypatch.setattr(fmt, "read_store_record", lambda root: records.append(root) or real_record(root))
    summary = push(store.root, (tmp_path / "remote").as_uri())
    assert summary.copied == ["vae/v2"] and summary.garbage == ["vae/v1"], summary
    assert len(records) == 1, records


def test_the_keep_rule_lists_the_versions_once_whatever_the_live_leases(store: Store, monkeypatch) -> None:
    """gc's keep rule listed every version of every table again for each live lease (a reader per rank: 64 leases
    on 8 nodes, 65 listings of each table's folder per plan, per push, per cache eviction); once now."""
    from store import lease

    for i, tag in enumerate("ab"):  # v1 replaced by v2: the keep rule is asked
        fill(store, 3, tag=tag, start=10 * i)
    listings = []
    real_list = fmt.list_versions
    monkeypatch.setattr(fmt, "list_versions", lambda root, table: listings.append(table) or real_list(root, table))
    assert gc.not_kept(store.root) == ({("vae", 1)}, [])
    without_leases = len(listings)
    assert without_leases == 1, listings  # one table: its folder listed once (twice before: complete, then every)
    readers = [lease.hold(store.root, {"vae": 1}, f"reader {rank}") for rank in range(3)]
    try:
        listings.clear()
        assert gc.not_kept(store.root) == (set(), [])  # v1 read: kept
        assert len(listings) == without_leases, listings
    finally:
        for held in readers:
            held.release()


def test_a_whole_url_pull_reads_each_versions_checksums_once(store: Store, tmp_path: Path, monkeypatch) -> None:
    """The URL's keep rule reads the checksums.json of each version it keeps (its schema.json checked against it),
    and the pull read it again to copy the version: megabytes each at 1M samples, two GETs. Once now."""
    url = (tmp_path / "remote").as_uri()
    _replaced_twice(store, url)
    gets = _store_json_gets(monkeypatch)
    summary = pull(url, tmp_path / "copy")
    assert summary.copied == ["vae/v3"] and summary.garbage == ["vae/v1", "vae/v2"], summary
    sums = {rel: n for rel, n in gets.items() if rel.endswith(fmt.CHECKSUMS)}
    assert sums == {f"vae/v3/{fmt.CHECKSUMS}": 1}, gets
    with Store(tmp_path / "copy", create=False).reader("vae") as r:
        assert r.version == 3 and len(r.keys()) == 3
