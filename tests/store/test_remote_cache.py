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
from store.remote_sync import push
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
    monkeypatch.setattr(remote_mod.Remote, "read", lambda self, rel: read.append(rel) or real_read(self, rel))
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
