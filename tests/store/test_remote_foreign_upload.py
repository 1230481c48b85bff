"""A store copied to a bucket by another tool (`aws s3 sync STORE s3://bucket/prefix`, `s5cmd`, `rclone`: much
faster than anything one process sends, at a million samples): its objects carry no CRC32C of ours (`x-amz-meta-
crc32c`). Before, every later `pipeline store push` of that store took the versions already there for another
store's ("differs between the store and the remote") and sent nothing new, for ever: an object's CRC32C came only
from that metadata. Now an object without it is read back and its bytes decide. Against the S3 test server."""

from __future__ import annotations

from pathlib import Path

import pytest

from store_samples import fill

from store import Store
from store.remote_pull import pull
from store.remote_push import push
from store.verify import verify_store


def _sync(s3_env, root: Path, prefix: str = "store") -> None:
    """What `aws s3 sync` does: every file a plain PUT, no metadata."""
    client = s3_env.client()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")
                       and not any(part.startswith(".") for part in p.relative_to(root).parts)):
        client.put_object(Bucket=s3_env.bucket, Key=f"{prefix}/{path.relative_to(root)}", Body=path.read_bytes())


def test_a_push_after_another_tool_copied_the_store_sends_only_what_is_new(s3_env, store: Store, tmp_path: Path):
    fill(store, 4)
    _sync(s3_env, store.root)
    fill(store, 4, tag="b")  # a new version, made after the copy
    summary = push(store.root, s3_env.url())
    assert summary.present == ["vae/v1"] and summary.copied == ["vae/v2"]
    pulled = tmp_path / "pulled"
    pull(s3_env.url(), pulled)
    assert Store(pulled, create=False).tables() == {"vae": 2} and verify_store(pulled, progress=False) == []


def test_a_second_push_of_a_copied_store_reads_none_of_its_objects_again(s3_env, store: Store, monkeypatch):
    """An object another tool uploaded has no CRC32C of ours, so a push reads it back to compare (a manifest per
    version present, every object of a version not complete there). Before, every later push read it again: its
    CRC was neither cached nor written. Now the CRC read is remembered by the object's ETag and size
    (store/remote_crcs.py): a second push reads nothing; an object replaced since (a new ETag) is read again."""
    from schemas import UserError
    from store import remote_download

    fill(store, 4)
    _sync(s3_env, store.root)
    reads: list[str] = []
    real = remote_download.pieces

    def counted(fs, path, *a, **k):
        reads.append(path)
        return real(fs, path, *a, **k)

    monkeypatch.setattr(remote_download, "pieces", counted)
    assert push(store.root, s3_env.url()).present == ["vae/v1"]
    assert [p.rsplit("/", 3)[-3:] for p in reads] == [["vae", "v1", "manifest.parquet"]]
    reads.clear()
    assert push(store.root, s3_env.url()).present == ["vae/v1"]
    assert reads == []  # known by its ETag
    manifest = store.root / "vae" / "v1" / "manifest.parquet"
    other = manifest.read_bytes()[:-1] + b"\0"  # same size, other bytes: only a read tells
    s3_env.client().put_object(Bucket=s3_env.bucket, Key="store/vae/v1/manifest.parquet", Body=other)
    with pytest.raises(UserError, match="manifest.parquet .crc32c not the recorded .*damaged at the URL"):
        push(store.root, s3_env.url())
    # replaced: read again, and refused; its checksums.json read once (the version's own record there: the manifest
    # is damaged, not another store's)
    assert [p.rsplit("/", 1)[-1] for p in reads] == ["manifest.parquet", "checksums.json"]


def test_the_remembered_crc_of_an_object_is_not_taken_for_the_same_name_at_another_endpoint(
        s3_env, store: Store, monkeypatch):
    """The CRC32C read from an object is remembered by its endpoint too (store/remote_crcs.py): the same bucket and
    key at another endpoint (MinIO beside AWS; here the test server under a second name) is another object, read
    once there. Before, the cache was keyed by s3://bucket/key, ETag and size alone, shared across endpoints."""
    from store import remote_crcs, remote_download

    fill(store, 4)
    _sync(s3_env, store.root)
    reads: list[str] = []
    real = remote_download.pieces
    monkeypatch.setattr(remote_download, "pieces",
                        lambda fs, path, *a, **k: reads.append(path) or real(fs, path, *a, **k))
    assert push(store.root, s3_env.url()).present == ["vae/v1"] and len(reads) == 1
    other = s3_env.endpoint.replace("127.0.0.1", "localhost")
    assert other != s3_env.endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL", other)
    reads.clear()
    assert push(store.root, s3_env.url()).present == ["vae/v1"]
    assert [p.rsplit("/", 3)[-3:] for p in reads] == [["vae", "v1", "manifest.parquet"]]  # another endpoint's object
    reads.clear()
    assert push(store.root, s3_env.url()).present == ["vae/v1"] and reads == []  # remembered for this endpoint too
    keys = set(remote_crcs._known()[1])
    assert {k.split(" ", 1)[0] for k in keys} == {s3_env.endpoint, other}, keys
