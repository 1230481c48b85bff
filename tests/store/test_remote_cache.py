"""The cache of a store URL (store/remote_cache.py) against the S3 test server: a warm open (the current versions
cached already) asks the server for store.json and each version's checksums.json only, never a listing of the
prefix, and still refuses a cached version the remote no longer holds under that number."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.errors import UserError
from store import Store
from store import remote as remote_mod
from store.remote_cache import local_store
from store.remote_push import push
from store_samples import fill



def test_a_warm_open_lists_nothing_and_refuses_a_changed_version(s3_env, store: Store, tmp_path: Path,
                                                                 monkeypatch) -> None:
    fill(store, 8)
    push(store.root, s3_env.url())
    cache = tmp_path / "cache"
    root = local_store(s3_env.url(), ["vae"], cache)  # cold: listed and pulled

    read: list[str] = []
    real_read, real_listing = remote_mod.Remote.read, remote_mod.Remote.listing
    monkeypatch.setattr(remote_mod.Remote, "listing", lambda self: pytest.fail("a warm open listed the prefix"))
    monkeypatch.setattr(remote_mod.Remote, "read",
                        lambda self, rel, small=False: read.append(rel) or real_read(self, rel, small))
    assert local_store(s3_env.url(), ["vae"], cache) == root
    assert read == ["store.json", "vae/v1/checksums.json"]
    monkeypatch.setattr(remote_mod.Remote, "listing", real_listing)
    monkeypatch.setattr(remote_mod.Remote, "read", real_read)

    # the prefix emptied and another store pushed into it: v1 there is not the cached v1
    client = s3_env.client()
    for o in client.list_objects_v2(Bucket=s3_env.bucket)["Contents"]:
        client.delete_object(Bucket=s3_env.bucket, Key=o["Key"])
    other = Store(tmp_path / "other")
    fill(other, 5, tag="b")
    push(other.root, s3_env.url())
    with pytest.raises(UserError, match="vae v1 differs"):
        local_store(s3_env.url(), ["vae"], cache)


def _cache_with_an_unpushed_version(s3_env, tmp_path: Path, prefix: str):
    """A remote holding vae v1 (8 samples) under `prefix`, a cache of it, and v2 (40 samples) committed in the cache
    alone (its push_back never ran). Returns url, cache, the cache's store root, v2's number, folder and size."""
    from store import format as fmt
    from store.remote_cache import push_back

    url = s3_env.url(prefix)
    src = Store(tmp_path / "src")
    fill(src, 8, tag="a")
    push_back(url, src.root)  # the remote: vae v1
    cache = tmp_path / "cache"
    root = local_store(url, ["vae"], cache, lease=False)
    v = fill(Store(root), 40, tag="b", start=100)  # committed in the cache; push_back never ran
    vdir = fmt.version_dir(root, "vae", v)
    return url, cache, root, v, vdir, sum(p.stat().st_size for p in vdir.iterdir())


def test_a_version_committed_only_in_the_cache_is_never_evicted_before_its_push(s3_env, tmp_path: Path,
                                                                                caplog) -> None:
    """An encoder committed v2 into the cache and its push failed (or was killed): until the rerun pushes it, that
    version is the only copy of the work. An open with a size limit it does not fit (the rerun itself, or train on
    that node) evicted it whole; it keeps it now (over the limit, with a warning), the rerun pushes it, and then it is
    a copy of the remote's like any other."""
    from store import format as fmt
    from store.remote_cache import push_back

    url, cache, root, v, vdir, size = _cache_with_an_unpushed_version(s3_env, tmp_path, "unpushed")

    with caplog.at_level("WARNING", logger="store"):
        local_store(url, ["vae"], cache, limit_gb=size / 2 / 1e9, lease=False)  # the rerun's open
    assert fmt.is_complete(vdir) and "never pushed" in caplog.text
    with Store(root, create=False).reader("vae", v) as r:
        assert len(r.keys()) == 40

    Store(root).set_current("vae", v)  # the rerun's stage finds it up to date (stages/encode/output.adopt)...
    assert push_back(url, root).copied == [f"vae/v{v}"]  # ...and pushes it
    assert local_store(url, ["vae"], cache, limit_gb=size / 2 / 1e9, lease=False) == root
    assert Store(root).tables()["vae"] == v and not list(vdir.glob("*.tar"))  # a copy now: its shards evictable


def test_a_version_committed_in_the_cache_that_a_newer_one_replaced_is_evicted_not_owed(s3_env, tmp_path: Path,
                                                                                          caplog) -> None:
    """v2 committed in the cache, its push failed; the rerun with other settings committed v3 and pushed it. v2 is
    garbage by the cache's own record (push leaves it out, as the store's gc removes it), so an open over the limit
    evicts it whole. Before, it was kept as "never pushed" for ever: counted against the limit, warned of at every
    open, and no rerun would ever push it."""
    from store.remote_cache import push_back

    url, cache, root, v, vdir, size = _cache_with_an_unpushed_version(s3_env, tmp_path, "replaced")
    newer = fill(Store(root), 4, tag="c", start=200)  # the rerun with other settings
    summary = push_back(url, root)
    assert summary.copied == [f"vae/v{newer}"] and summary.garbage == [f"vae/v{v}"], summary

    with caplog.at_level("WARNING", logger="store"):
        local_store(url, ["vae"], cache, limit_gb=size / 2 / 1e9, lease=False)
    assert not vdir.exists() and "never pushed" not in caplog.text, caplog.text
    with Store(root, create=False).reader("vae") as r:
        assert r.version == newer and len(r.keys()) == 4


def test_a_version_committed_in_the_cache_that_another_writers_push_replaced_is_kept(s3_env, tmp_path: Path,
                                                                                    caplog) -> None:
    """v2 committed in the cache, its push failed; ANOTHER writer then pushed v3 (its own v2 replaced before it
    pushed: never sent), and an open made v3 current in the cache. The cache's v2 was never sent: the only copy of
    its work, which the rerun of its settings adopts (`find_version`) and pushes. Kept over the limit (warned of as
    never pushed); before, it was evicted as garbage, as if the cache's own writer had moved past it."""
    from store import format as fmt
    from store_samples import vae_schema

    url = s3_env.url("another")
    other = Store(tmp_path / "other")
    fill(other, 8, tag="a")
    push(other.root, url)  # the remote: vae v1
    cache = tmp_path / "cache"
    root = local_store(url, ["vae"], cache, lease=False)
    v = fill(Store(root), 40, tag="b", start=100)  # committed in the cache; push_back never ran
    vdir = fmt.version_dir(root, "vae", v)
    size = sum(p.stat().st_size for p in vdir.iterdir())
    fill(other, 4, tag="x", start=300)  # the other writer: its v2, replaced by its v3 before its push
    newer = fill(other, 4, tag="y", start=400)
    summary = push(other.root, url)
    assert summary.copied == [f"vae/v{newer}"] and summary.garbage == [f"vae/v{v}"], summary

    with caplog.at_level("WARNING", logger="store"):
        local_store(url, ["vae"], cache, limit_gb=size / 2 / 1e9, lease=False)
    assert fmt.is_complete(vdir) and "never pushed" in caplog.text, caplog.text
    cached = Store(root, create=False)
    assert cached.tables()["vae"] == newer and cached.find_version("vae", vae_schema("b").lineage) == v
    with cached.reader("vae", v) as r:
        assert len(r.keys()) == 40


def test_a_part_left_in_the_cache_under_a_number_the_remote_holds_complete_is_removed(s3_env, tmp_path: Path) -> None:
    """A node's part of v1 (a commit on several caches whose store.json swap was lost; the rerun, with other
    settings, committed v2): the remote holds v1 complete, so the part can never be committed, and the cache limit
    counted it for ever (a writer's version in progress is never evicted). An open sets it aside; a part above the
    current version (a writer's, perhaps live) stays."""
    import json

    from store import format as fmt

    url = s3_env.url("left")
    src = Store(tmp_path / "src")
    fill(src, 4, tag="a")
    push(src.root, url)  # while current (a superseded version is not pushed)
    fill(src, 4, tag="b")
    push(src.root, url)  # v1 and v2 complete there, v2 current
    root = local_store(url, ["vae"], tmp_path / "cache", lease=False)
    for v in (1, 3):
        part = fmt.version_dir(root, "vae", v)
        part.mkdir()
        (part / fmt.SCHEMA_JSON).write_text(json.dumps({"name": "vae", "a": "part"}))
        (part / "shard-r01-000000.tar").write_bytes(b"x" * 1000)
    local_store(url, ["vae"], tmp_path / "cache", lease=False)
    assert fmt.list_versions(root, "vae") == [2, 3] and fmt.is_complete(fmt.version_dir(root, "vae", 2))


def test_a_version_an_older_cache_pulled_whole_is_still_evicted(s3_env, tmp_path: Path, caplog) -> None:
    """Caches of earlier versions of this code pulled whole versions without marking them as the remote's; the
    versions never pushed are kept now, but those, found identical on the remote, are marked and evicted as before."""
    from store import format as fmt

    url = s3_env.url("older")
    src = Store(tmp_path / "src")
    fill(src, 40, tag="a")
    push(src.root, url)
    cache = tmp_path / "cache"
    root = local_store(url, ["vae"], cache, whole=True, lease=False)  # v1 whole, unmarked
    old = fmt.version_dir(root, "vae", 1)
    size = sum(p.stat().st_size for p in old.iterdir())
    fill(src, 4, tag="b", start=50)
    push(src.root, url)  # v2 current
    with caplog.at_level("WARNING", logger="store"):
        local_store(url, ["vae"], cache, limit_gb=size / 2 / 1e9, lease=False)
    assert not old.exists() and "never pushed" not in caplog.text


def test_a_damaged_cache_marker_is_one_line_and_the_next_open_writes_it_again(s3_env, store: Store, tmp_path: Path,
                                                                            caplog) -> None:
    """The marker of a cached version (`.remote.json`: where its shards are fetched from) damaged on this node's
    disk: a reader is refused in one line naming it (before, json's traceback in every reader of the node, for
    ever), and the next open of the URL, which checks the cached version is the URL's, writes it again."""
    import logging

    import torch

    from store import format as fmt
    from store import remote_shards

    fill(store, 8)
    push(store.root, s3_env.url())
    cache = tmp_path / "cache"
    root = local_store(s3_env.url(), ["vae"], cache, lease=False)
    vdir = fmt.version_dir(root, "vae", 1)
    (vdir / remote_shards.MARKER).write_text('{"url": "s3://')  # torn
    remote_shards._fetchers.pop(str(vdir), None)  # as in a new process: no fetcher made before the damage
    with pytest.raises(UserError, match=r"\.remote\.json is damaged .*rerun"):
        Store(root, create=False).reader("vae")
    with caplog.at_level(logging.WARNING, logger="store"):
        assert local_store(s3_env.url(), ["vae"], cache, lease=False) == root
    assert any(".remote.json: damaged on this node" in r.getMessage() for r in caplog.records)
    with store.reader("vae") as local, Store(root, create=False).reader("vae") as cached:
        for k in local.keys():
            a, b = cached.tensors(k), local.tensors(k)
            assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_cached_store_json_damaged_on_the_node_is_written_again_by_the_next_open(s3_env, store: Store,
                                                                                  tmp_path: Path, caplog) -> None:
    """The cache's store.json (a copy of the URL's current versions, set by every open) torn on this node's disk:
    every open on the node said to run `pipeline store repair` on the cache folder, which refuses a cache. Now the
    open writes it again and the readers read."""
    import logging

    import torch

    fill(store, 8)
    push(store.root, s3_env.url())
    cache = tmp_path / "cache"
    root = local_store(s3_env.url(), ["vae"], cache, lease=False)
    (root / "store.json").write_text('{"tabl')
    with caplog.at_level(logging.WARNING, logger="store"):
        assert local_store(s3_env.url(), ["vae"], cache, lease=False) == root
    assert any("store.json is damaged on this node" in r.getMessage() for r in caplog.records)
    assert Store(root, create=False).tables() == {"vae": 1}
    with store.reader("vae") as local, Store(root, create=False).reader("vae") as cached:
        for k in local.keys():
            a, b = cached.tensors(k), local.tensors(k)
            assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
