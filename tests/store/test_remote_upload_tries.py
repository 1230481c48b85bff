"""An upload sent again by s3fs's own loop of tries (store/remote.S3FS_TRIES, after botocore's AWS_MAX_ATTEMPTS
answers of 503 SlowDown: a throttled prefix, 8 nodes pushing at once) must send the whole body again. Before, the
retry reused the BytesIO the previous try had read to its end: botocore took its length, 0, from there, and the
server created an empty object (a truncated one for a multipart upload's last part) that push counted as sent. Against
the S3 test server, behind tests/store/fault_proxy.py."""

from __future__ import annotations

import os
from urllib.parse import parse_qs

import pytest
from fault_proxy import FaultProxy
from remote_fakes import NoBar

from store import remote as remote_mod
from store.checksum import file_crc


def _throttled(s3_env, monkeypatch, part: str | None, tries: int) -> FaultProxy:
    """A proxy answering 503 SlowDown to the first `tries` PUTs of the object (`part`: of that part number only; the
    test environment's botocore makes AWS_MAX_ATTEMPTS=2 tries: 2 answers leave the next to s3fs's loop)."""
    seen = []

    def fault(method: str, path: str) -> str | None:
        where, _, query = path.partition("?")
        if method == "PUT" and where.endswith("/x/shard.tar") and parse_qs(query).get("partNumber", [None])[0] == part:
            seen.append(path)
            return "slow" if len(seen) <= tries else None
        return None

    proxy = FaultProxy(s3_env.endpoint, fault)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    return proxy


def _sent(s3_env, monkeypatch, local, part: str | None = None) -> bytes:
    proxy = _throttled(s3_env, monkeypatch, part, tries=2)
    try:
        remote = remote_mod.open_remote(s3_env.url())
        assert remote.upload(local, "x/shard.tar", file_crc(local)[0], NoBar(), local.stat().st_size)
    finally:
        proxy.stop()
    assert len(proxy.faults) == 2  # botocore's tries spent: s3fs's loop sent the request once more
    return s3_env.client().get_object(Bucket=s3_env.bucket, Key="store/x/shard.tar")["Body"].read()


def test_a_put_sent_again_after_throttling_sends_every_byte(s3_env, tmp_path, monkeypatch):
    local = tmp_path / "shard.tar"
    local.write_bytes(os.urandom(200_000))
    got = _sent(s3_env, monkeypatch, local)
    assert len(got) == local.stat().st_size  # before: 0 bytes, the upload reported as done
    assert got == local.read_bytes()


@pytest.mark.parametrize("part_number", [2, 3])
def test_a_part_sent_again_after_throttling_sends_every_byte(s3_env, tmp_path, monkeypatch, part_number):
    """A middle part sent empty failed the completion (a part under S3's minimum); the last part sent empty
    completed an object cut short by that part."""
    import moto.s3.models

    part = 2 * 2**20  # S3's smallest is 5 MiB: the test server is told 2 MiB
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", part)
    monkeypatch.setattr(remote_mod, "PART", part)
    local = tmp_path / "shard.tar"
    local.write_bytes(os.urandom(2 * part + part // 2))  # three parts, the last one half a part
    got = _sent(s3_env, monkeypatch, local, str(part_number))
    assert len(got) == local.stat().st_size
    assert got == local.read_bytes()


def test_a_push_throttled_on_one_shard_commits_the_version(s3_env, store, monkeypatch):
    """What a user saw: push's look before the manifest found the empty shard and refused the version as "an
    incomplete version with other contents ... from another store", blocked for an hour (gc's grace) - a rerun met
    the same empty object. Now the push completes and every object is the local file."""
    from store_samples import fill

    from store.remote_push import push

    fill(store, 6)
    seen = []

    def fault(method: str, path: str) -> str | None:
        if method == "PUT" and path.partition("?")[0].endswith("/shard-r00-000001.tar"):
            seen.append(path)
            return "slow" if len(seen) <= 2 else None
        return None

    proxy = FaultProxy(s3_env.endpoint, fault)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        summary = push(store.root, s3_env.url())
    finally:
        proxy.stop()
    assert summary.copied == ["vae/v1"] and len(proxy.faults) == 2
    client, vdir = s3_env.client(), store.root / "vae" / "v1"
    for f in sorted(vdir.iterdir()):
        got = client.get_object(Bucket=s3_env.bucket, Key=f"store/vae/v1/{f.name}")["Body"].read()
        assert got == f.read_bytes(), f.name
