"""A reader takes its lease on a version after `store gc URL` looked at the leases for it but before gc deleted it.
gc re-lists the leases after the manifest DELETE (the commit point: from then on no reader's open check passes) and
holds back the data of a version a lease now names, so the reader - whose manifest check passed before that DELETE -
reads intact data; one that checks after it stops in one line. Before, gc deleted the data too and the reader
failed on its first uncached shard. The interleavings are fixed by hooks between gc's steps, no sleeps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from schemas.errors import UserError
from store import Store, remote_gc, remote_lease
from store import remote as remote_mod
from store.remote_cache import local_store
from store.remote_push import push
from store_samples import fill, sample


def _objects(s3_env, prefix: str) -> list[str]:
    out = s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix=f"store/{prefix}").get("Contents", [])
    return sorted(o["Key"] for o in out)


@pytest.fixture
def v1_cached(s3_env, store: Store, tmp_path: Path) -> Path:
    """v1 opened lazily (metadata only, no lease yet) from the remote, then v2 pushed and made current."""
    fill(store, 12, tag="a")
    push(store.root, s3_env.url())
    root = local_store(s3_env.url(), ["vae"], tmp_path / "cache", lease=False)
    fill(store, 4, tag="b", start=40)
    push(store.root, s3_env.url())
    return root


def test_a_lease_taken_after_gc_looked_keeps_the_data_and_the_reader_reads_intact(
        s3_env, store: Store, v1_cached: Path, monkeypatch) -> None:
    url = s3_env.url()
    real_doomed = remote_gc._still_doomed
    took: list[str] = []

    def lease_after_the_look(remote, v):
        keepers = real_doomed(remote, v)  # no lease names v1 yet: doomed
        if v.name == "vae/v1":
            remote_lease.hold_reading(url, [("vae", 1)], root=v1_cached)  # PUT, then v1's manifest: still there
            took.append(v.name)
        return keepers

    monkeypatch.setattr(remote_gc, "_still_doomed", lease_after_the_look)
    messages: list[str] = []
    try:
        remote_gc.collect(url, echo=messages.append)
        assert took == ["vae/v1"]
        assert "store/vae/v1/manifest.parquet" not in _objects(s3_env, "vae/v1/")  # v1 is gone for new readers
        with Store(v1_cached, create=False).reader("vae", 1) as r:  # every shard fetched now, from the remote
            assert len(r.keys()) == 12
            for i in range(12):
                want, got = sample(i)["tensors"], r.tensors(sample(i)["key"])
                assert all(torch.equal(want[k], got[k]) for k in want)
        assert any(m.startswith("keep the data of vae/v1") for m in messages), messages
    finally:
        remote_lease.release_reading(url)
    # the lease released, a later gc removes what was held back (an incomplete version no lease names)
    monkeypatch.setattr(remote_gc, "_still_doomed", real_doomed)
    remote_gc.collect(url, grace_s=0, echo=lambda m: None)
    assert _objects(s3_env, "vae/v1/") == []
    assert _objects(s3_env, "vae/v2/")


def test_a_lease_taken_after_the_manifest_delete_stops_the_reader(s3_env, v1_cached: Path, monkeypatch) -> None:
    url = s3_env.url()
    real_delete = remote_mod.Remote.delete
    stopped: list[str] = []

    def lease_after_the_manifest_delete(self, rels):
        real_delete(self, rels)
        if rels == ["vae/v1/manifest.parquet"]:
            with pytest.raises(UserError, match="vae v1 was removed .* rerun") as e:
                remote_lease.hold_reading(url, [("vae", 1)], root=v1_cached)
            stopped.append(str(e.value))

    monkeypatch.setattr(remote_mod.Remote, "delete", lease_after_the_manifest_delete)
    try:
        remote_gc.collect(url, echo=lambda m: None)
    finally:
        remote_lease.release_reading(url)
    assert len(stopped) == 1 and "\n" not in stopped[0]
    assert remote_lease._held.get(url) is None  # it released its lease: nothing of v1 is read
