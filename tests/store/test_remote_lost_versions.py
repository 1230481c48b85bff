"""A remote that lost versions a lazy cache still describes (a deleted prefix, a restarted in-memory server, as
when the README's S3 demo is rerun after `moto_server` was restarted): pushing that cache counted its versions as
"already there" and wrote a store.json naming versions with no objects, and every later command failed with "an
object disappeared meanwhile?; rerun". Now the push refuses in one line naming the cache to remove, and the remote
keeps no record of versions it lacks."""

from __future__ import annotations

import pytest

from schemas.errors import UserError
from store import Store
from store.checksum import unseal
from store.remote_cache import local_store
from store.remote_push import push
from store_samples import fill


def test_a_lazy_cache_of_versions_the_remote_lost_is_refused_not_recorded(s3_env, store: Store, tmp_path):
    fill(store, 8)
    url = s3_env.url()
    push(store.root, url)
    cached = local_store(url, ["vae"], tmp_path / "cache")  # metadata only: the shards stay on the remote
    client = s3_env.client()
    for o in client.list_objects_v2(Bucket=s3_env.bucket).get("Contents", []):  # the remote loses everything
        client.delete_object(Bucket=s3_env.bucket, Key=o["Key"])

    with pytest.raises(UserError, match=r"vae v1 is cached in .* but is no longer at .*: remove .* and rerun") as e:
        push(cached, url)
    assert "\n" not in str(e.value)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_env.bucket).get("Contents", [])]
    if "store/store.json" in keys:  # no record of a version whose objects are not there
        body = client.get_object(Bucket=s3_env.bucket, Key="store/store.json")["Body"].read()
        assert not unseal(body)["tables"], unseal(body)


def test_a_cache_of_a_remote_rebuilt_since_names_the_cache_to_remove(s3_env, tmp_path):
    """`pipeline store verify URL` (the default cache) after the remote was rebuilt with other contents under the
    same version numbers: the line said "push/pull into an empty prefix or folder instead"; the stale copy is a
    cache, and removing it is what to do."""
    url = s3_env.url()
    first, second = Store(tmp_path / "first"), Store(tmp_path / "second")
    fill(first, 4)
    fill(second, 5)
    push(first.root, url)
    cached = local_store(url, None, tmp_path / "cache", whole=True)
    client = s3_env.client()
    for o in client.list_objects_v2(Bucket=s3_env.bucket).get("Contents", []):
        client.delete_object(Bucket=s3_env.bucket, Key=o["Key"])
    push(second.root, url)  # the same table names and version numbers, other samples

    with pytest.raises(UserError, match=r"vae v1 differs between the cache .* and .*; remove .* \(a cache\) and rerun") as e:
        local_store(url, None, tmp_path / "cache", whole=True)
    assert str(cached) in str(e.value) and "\n" not in str(e.value)


def test_two_caches_that_wrote_the_same_version_number_the_second_push_says_so(store: Store, tmp_path):
    """Two nodes' encoders wrote the next version of a table into their own caches at once: the first push made it
    the remote's; the second met another manifest under that number and said the remote "was rebuilt since (a
    deleted prefix, a restarted in-memory server)", which sends the user looking for a loss that did not happen.
    The line names both causes, and what to do is the same: remove the cache, rerun (the remote's version is read)."""
    from store.remote_cache import push_back

    fill(store, 4)
    url = f"file://{tmp_path / 'remote'}"
    push(store.root, url)
    first, second = (local_store(url, None, tmp_path / name, lease=False) for name in ("a", "b"))
    fill(Store(first), 3, start=10)  # vae v2 in each cache, other samples
    fill(Store(second), 5, start=20)
    assert push_back(url, first).copied == ["vae/v2"]
    with pytest.raises(UserError, match=r"vae v2 differs between the cache .*; remove .* \(a cache\) and rerun") as e:
        push_back(url, second)
    assert "another writer committed v2 there first" in str(e.value) and "\n" not in str(e.value)
