"""An object whose bytes arrive other than the server's own checksum of them (botocore compares a GET's body with the
CRC the server stored at the PUT, and raises FlexibleChecksumError at its end): damaged on the way (a plain-http
endpoint, a faulty proxy or NIC) or at rest. Before, botocore's traceback ended pull, the lazy cache's fetch and the
metadata reads; now the bytes go to the store's own checks, which name the object (pull), or read the samples by
range instead (a lazy fetch), and a small object read whole is read once more, then named. Against the S3 test
server behind tests/store/fault_proxy.py, flipping one bit of the chosen GETs' bodies (headers as the server sent)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fault_proxy import FaultProxy
from store_samples import fill

from schemas.errors import UserError
from store import Store
from store import format as fmt
from store import remote as remote_mod
from store.remote_pull import pull
from store.remote_push import push

SHARD = "shard-r00-000001.tar"
ONE_SHARD = "shard-r00-000000.tar"  # a store of one shard (fill's shard_size_mb=1)


def _flipping(s3_env, monkeypatch, name: str, times: int = 1000) -> FaultProxy:
    """A proxy flipping a bit of the body of the first `times` GETs of objects named `name`."""
    flipped = []

    def fault(method: str, path: str) -> str | None:
        if method == "GET" and path.partition("?")[0].endswith("/" + name) and len(flipped) < times:
            flipped.append(path)
            return "flip"
        return None

    proxy = FaultProxy(s3_env.endpoint, fault)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    return proxy


@pytest.fixture
def pushed(s3_env, store: Store) -> Store:
    fill(store, 6)
    push(store.root, s3_env.url())
    return store


def test_pull_names_an_object_that_arrives_damaged(s3_env, pushed: Store, tmp_path: Path, monkeypatch):
    proxy = _flipping(s3_env, monkeypatch, SHARD)
    try:
        with pytest.raises(UserError, match=f"{s3_env.url()}/vae/v1/{SHARD} is damaged") as e:
            pull(s3_env.url(), tmp_path / "pulled")
    finally:
        proxy.stop()
    assert proxy.faults and "\n" not in str(e.value)
    assert not fmt.list_versions(tmp_path / "pulled", "vae")  # nothing of the version became visible


def test_a_lazy_fetch_that_arrives_damaged_reads_the_samples_by_range(s3_env, pushed: Store, tmp_path: Path,
                                                                     monkeypatch):
    from store import remote_shards
    from store.remote_cache import local_store

    monkeypatch.setattr(remote_shards, "WHOLE_AFTER", 0)  # the first read of a shard fetches it whole
    proxy = _flipping(s3_env, monkeypatch, SHARD, times=1)  # that fetch damaged on the way; the ranges after it not
    try:
        root = local_store(s3_env.url(), ["vae"], tmp_path / "cache")
        with Store(root, create=False).reader("vae") as cached, pushed.reader("vae") as local:
            keys = [k for k in local.keys() if local.view.samples.shard_of(local.row_of(k)) == SHARD]
            assert keys
            for k in keys:
                got, want = cached.tensors(k), local.tensors(k)
                assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    finally:
        proxy.stop()
    assert len(proxy.faults) == 1  # the whole fetch arrived damaged and was not cached
    assert not (fmt.version_dir(root, "vae", 1) / SHARD).exists()


@pytest.mark.parametrize("times", [1, 2])
def test_a_small_object_that_arrives_damaged_is_read_again_then_named(s3_env, pushed: Store, monkeypatch, times):
    proxy = _flipping(s3_env, monkeypatch, fmt.CHECKSUMS, times)
    try:
        remote = remote_mod.open_remote(s3_env.url())
        if times == 1:  # damaged on the way once: the second read is the object
            assert remote.read(f"vae/v1/{fmt.CHECKSUMS}") == (pushed.root / "vae" / "v1" / fmt.CHECKSUMS).read_bytes()
        else:
            with pytest.raises(UserError, match=f"{s3_env.url()}/vae/v1/{fmt.CHECKSUMS} is damaged: read twice"):
                remote.read(f"vae/v1/{fmt.CHECKSUMS}")
    finally:
        proxy.stop()
    assert len(proxy.faults) == times


def test_a_server_that_ignores_range_reads_is_read_right(s3_env, store: Store, tmp_path: Path, monkeypatch):
    """A server or proxy that ignores Range answers a sample's range read with the whole object (200): the lazy
    reader refused every sample as damaged ("the shard ends -N bytes before the sample does"). The sample's bytes
    are taken out of the whole object, and the shard is then kept whole in the cache (one fetch, not one per
    sample)."""
    from store.remote_cache import local_store

    fill(store, 6, shard_size_mb=1)  # one shard of several samples
    push(store.root, s3_env.url())
    pushed = store

    def fault(method: str, path: str) -> str | None:
        return "norange" if method == "GET" and path.partition("?")[0].endswith("/" + ONE_SHARD) else None

    proxy = FaultProxy(s3_env.endpoint, fault)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        root = local_store(s3_env.url(), ["vae"], tmp_path / "cache")
        with Store(root, create=False).reader("vae") as cached, pushed.reader("vae") as local:
            keys = [k for k in local.keys() if local.view.samples.shard_of(local.row_of(k)) == ONE_SHARD]
            assert len(keys) > 1
            for k in keys:
                got, want = cached.tensors(k), local.tensors(k)
                assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    finally:
        proxy.stop()
    assert proxy.faults  # the range reads did arrive without their Range
    cached_shard = fmt.version_dir(root, "vae", 1) / ONE_SHARD
    assert cached_shard.read_bytes() == (fmt.version_dir(pushed.root, "vae", 1) / ONE_SHARD).read_bytes()
