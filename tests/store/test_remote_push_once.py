"""push reads each local file once (store/remote_upload.py): the CRC32C is computed over the very bytes sent, and a
file damaged after its version was sealed is refused with nothing visible under its key - a multipart upload is
aborted before its completion, a small object never PUT. Before, push read every file twice (a check, then s3fs's
own read for the upload): at 1M samples the whole store twice. Against the S3 test server (moto)."""

from __future__ import annotations

import builtins
import os
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

from schemas.errors import UserError
from store import Store
from store import format as fmt
from store import remote as remote_mod
from store.remote_gc import collect
from store.remote_pull import pull
from store.remote_push import push
from store.verify import verify_store
from stalled_push import push_killed_where_it_stalls
from store_samples import sample, vae_schema

BIG = 11 * 2**20  # with 5 MiB parts: three parts of a multipart upload


def _store(root: Path) -> Store:
    """One version: a shard of over 11 MiB (a sample with a big file) and small shards."""
    store = Store(root)
    w = store.writer("vae", vae_schema(), shard_size_mb=0.004)
    for i in range(6):
        s = sample(i)
        files = {"target.png": os.urandom(BIG)} if i == 0 else s["files"]
        w.add(s["key"], tensors=s["tensors"], files=files, meta=s["meta"])
    w.commit()
    return store


def _shards(root: Path) -> list[Path]:
    return sorted(fmt.version_dir(root, "vae", 1).glob("shard-*.tar"))


def _keys(env) -> set[str]:
    return {o["Key"] for o in env.client().list_objects_v2(Bucket=env.bucket).get("Contents", [])}


def _unfinished(env) -> list[str]:
    return [u["Key"] for u in env.client().list_multipart_uploads(Bucket=env.bucket).get("Uploads", [])]


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(remote_mod, "PART", 5 * 2**20)  # S3's smallest part


@pytest.fixture
def opens(monkeypatch) -> Counter:
    """How many times each local file is opened for reading (s3fs and our code open files with builtins.open)."""
    counted: Counter = Counter()
    real = builtins.open

    def counting(file, mode="r", *a, **kw):
        if isinstance(file, (str, Path)) and "r" in mode and "+" not in mode:
            counted[Path(file).name] += 1
        return real(file, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", counting)
    return counted


@pytest.mark.parametrize("where", ["s3", "file"])
def test_push_reads_each_shard_once_and_a_rerun_skips_them_all(s3_env, tmp_path, small_parts, opens, where) -> None:
    store = _store(tmp_path / "store")
    shards = _shards(store.root)
    assert shards[0].stat().st_size > BIG and len(shards) > 2  # one multipart upload, several single PUTs
    url = s3_env.url() if where == "s3" else f"file://{tmp_path}/remote"
    opens.clear()
    first = push(store.root, url)
    assert first.copied == ["vae/v1"]
    assert {s.name: opens[s.name] for s in shards} == {s.name: 1 for s in shards}  # was 2 each
    # the CRC32C recorded with each object (multipart or not) lets a rerun skip it without reading anything
    opens.clear()
    again = push(store.root, url)
    assert again.objects_sent == 0 and again.present == ["vae/v1"]
    assert not any(opens[s.name] for s in shards)
    pulled = tmp_path / "pulled"
    pull(url, pulled)
    assert verify_store(pulled) == []
    assert [p.read_bytes() for p in _shards(pulled)] == [p.read_bytes() for p in shards]


@pytest.mark.parametrize("which", ["big", "small"])
def test_a_shard_damaged_after_sealing_is_refused_with_nothing_visible(s3_env, tmp_path, small_parts, opens,
                                                                       which) -> None:
    store = _store(tmp_path / "store")
    shard = _shards(store.root)[0 if which == "big" else -1]
    data = bytearray(shard.read_bytes())
    data[len(data) * 2 // 3] ^= 0x01  # same size: only the bytes' CRC32C tells (in the last part when multipart)
    shard.write_bytes(bytes(data))
    opens.clear()
    with pytest.raises(UserError, match="is damaged") as e:
        push(store.root, s3_env.url())
    assert str(shard) in str(e.value) and "not sent" in str(e.value)
    assert opens[shard.name] == 1
    key = f"store/vae/v1/{shard.name}"
    assert key not in _keys(s3_env) and "store/vae/v1/manifest.parquet" not in _keys(s3_env)
    assert _unfinished(s3_env) == []  # the multipart upload was aborted: no parts left stored (and billed)


def test_a_push_that_fails_mid_multipart_leaves_nothing_visible_and_a_rerun_finishes(s3_env, tmp_path, small_parts,
                                                                                   monkeypatch) -> None:
    store = _store(tmp_path / "store")
    big = _shards(store.root)[0]
    real_open_remote, parts = remote_mod.open_remote, []

    def failing_open_remote(*a, **kw):  # the connection goes after the big shard's first part
        remote = real_open_remote(*a, **kw)
        real_call = remote.fs._call_s3

        async def call_s3(method, *args, **kwargs):
            if method == "upload_part" and kwargs["Key"].endswith(big.name):
                parts.append(kwargs["PartNumber"])
                if len(parts) > 1:
                    raise ConnectionResetError("connection reset by peer")
            return await real_call(method, *args, **kwargs)

        remote.fs._call_s3 = call_s3
        return remote

    monkeypatch.setattr("store.remote_push.open_remote", failing_open_remote)
    with pytest.raises(UserError, match="lost the connection"):
        push(store.root, s3_env.url())
    assert parts and f"store/vae/v1/{big.name}" not in _keys(s3_env) and _unfinished(s3_env) == []
    assert "store/vae/v1/manifest.parquet" not in _keys(s3_env)
    monkeypatch.setattr("store.remote_push.open_remote", real_open_remote)
    summary = push(store.root, s3_env.url())
    assert summary.copied == ["vae/v1"] and summary.objects_skipped > 0  # what the first run sent is kept
    pulled = tmp_path / "pulled"
    pull(s3_env.url(), pulled)
    assert verify_store(pulled) == []
    a, b = Store(store.root, create=False).reader("vae"), Store(pulled, create=False).reader("vae")
    key = sample(0)["key"]
    assert torch.equal(a.tensors(key)["target"], b.tensors(key)["target"])


def test_a_damaged_shard_is_not_linked_into_a_file_url(tmp_path, opens) -> None:
    """file:// (store/remote_local.py): the copy's bytes are checked before the link that makes the object exist."""
    store = _store(tmp_path / "store")
    shard = _shards(store.root)[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    opens.clear()
    with pytest.raises(UserError, match="is damaged") as e:
        push(store.root, f"file://{tmp_path}/remote")
    assert str(shard) in str(e.value) and opens[shard.name] == 1
    assert not (tmp_path / "remote" / "vae" / "v1" / shard.name).exists()
    assert not (tmp_path / "remote" / "vae" / "v1" / "manifest.parquet").exists()
    assert not any((tmp_path / "remote" / ".uploads").iterdir())  # the temp copy is gone too


def test_other_back_ends_stream_in_blocks_under_the_budget_and_refuse_damage(tmp_path, monkeypatch) -> None:
    """Any other fsspec back end (here fsspec's memory://): s3fs's budget did not cover it (the back end's
    `put_file`, whatever it holds, 16 at once). Now each upload streams through the back end's buffered writer in
    blocks of PART, reserving 2 x PART from the one budget; a damaged file is refused, nothing left at its key."""
    monkeypatch.setattr(remote_mod, "PART", 2**16)
    budget = remote_mod.ByteBudget(3 * 2**16)
    monkeypatch.setattr(remote_mod, "uploads_budget", budget)
    store = _store(tmp_path / "store")
    url = f"memory://h1-{tmp_path.name}/store"
    fs = remote_mod.open_remote(url).fs
    blocks = []
    real_open = type(fs).open

    def recording_open(self, path, mode="rb", *a, **kw):
        if "w" in mode and "/vae/v1/shard-" in path:
            blocks.append(kw.get("block_size"))
        return real_open(self, path, mode, *a, **kw)

    monkeypatch.setattr(type(fs), "open", recording_open)
    try:
        assert push(store.root, url).copied == ["vae/v1"]
        assert blocks and set(blocks) == {2**16} and 0 < budget.peak <= 3 * 2**16 and budget.held == 0
        pulled = tmp_path / "pulled"
        pull(url, pulled)
        assert verify_store(pulled) == []
        assert [p.read_bytes() for p in _shards(pulled)] == [p.read_bytes() for p in _shards(store.root)]

        other = _store(tmp_path / "other")
        shard = _shards(other.root)[0]
        data = bytearray(shard.read_bytes())
        data[-1000] ^= 0x01
        shard.write_bytes(bytes(data))
        url2 = url + "2"
        with pytest.raises(UserError, match="is damaged") as e:
            push(other.root, url2)
        assert str(shard) in str(e.value)
        assert not fs.exists(f"{fs._strip_protocol(url2)}/vae/v1/{shard.name}")
    finally:
        fs.rm(f"/h1-{tmp_path.name}", recursive=True)


# `pipeline store push` in a child process that stalls once every part of the big shard is stored, right before
# its CompleteMultipartUpload, after saying so in a file: the test SIGKILLs it there, without any timing assumption
# (stalled_push.py)
STALLING_PUSH = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from store import remote, remote_upload

    remote.PART = 5 * 2**20
    real = remote_upload.check

    def stalling(nbytes, crc, expect):
        if nbytes >= 2 * remote.PART:
            Path(sys.argv[3]).write_text("parts sent")
            time.sleep(3600)
        return real(nbytes, crc, expect)

    remote_upload.check = stalling
    from pipeline.cli import app
    app(["store", "push", sys.argv[1], sys.argv[2]])
""")


def test_a_push_killed_before_completing_a_multipart_upload_shows_nothing_and_gc_aborts_it(s3_env, tmp_path,
                                                                                         small_parts) -> None:
    store = _store(tmp_path / "store")
    big = _shards(store.root)[0]
    push_killed_where_it_stalls(STALLING_PUSH, store.root, s3_env.url(), tmp_path / "stalled",
                                "the big shard's completion")
    key = f"store/vae/v1/{big.name}"
    assert key not in _keys(s3_env) and _unfinished(s3_env) == [key]  # all its parts stored, no object
    summary = push(store.root, s3_env.url())  # the rerun sends the big shard again, whole
    assert summary.copied == ["vae/v1"] and key in _keys(s3_env)
    lines: list[str] = []
    collect(s3_env.url(), grace_s=0, echo=lines.append)  # the killed push's upload is stale at once here
    assert any("abort 1 unfinished multipart upload" in ln for ln in lines), lines
    assert _unfinished(s3_env) == []
    pulled = tmp_path / "pulled"
    pull(s3_env.url(), pulled)
    assert verify_store(pulled) == [] and (pulled / "vae" / "v1" / big.name).read_bytes() == big.read_bytes()


def test_a_resumed_push_takes_a_back_ends_own_crc32c_and_reads_nothing_back(tmp_path, monkeypatch) -> None:
    """Where the back end reports each object's CRC32C itself (GCS: `crc32c`, base64 of its 4 big-endian bytes, in
    gcsfs's listing entries), a resumed push compares that; before, it read every object already sent back in full
    (terabytes at 1M samples). memory:// stands in for GCS here, its entries given GCS's field."""
    import base64

    import crc32c as crc32c_lib

    store = _store(tmp_path / "store")
    url = f"memory://h1-{tmp_path.name}/store"
    fs = remote_mod.open_remote(url).fs
    real_info, real_open, read_back = type(fs).info, type(fs).open, []

    def gcs_info(self, path, **kw):
        out = real_info(self, path, **kw)
        if out.get("type") == "file":
            data = self.store[self._strip_protocol(path)].getvalue()
            out = {**out, "crc32c": base64.b64encode(crc32c_lib.crc32c(data).to_bytes(4, "big")).decode()}
        return out

    def counting_open(self, path, mode="rb", *a, **kw):
        if "r" in mode and "/vae/v1/" in path:
            read_back.append(path)
        return real_open(self, path, mode, *a, **kw)

    monkeypatch.setattr(type(fs), "info", gcs_info)
    monkeypatch.setattr(type(fs), "open", counting_open)
    try:
        push(store.root, url)
        root = fs._strip_protocol(url)
        fs.rm(f"{root}/vae/v1/manifest.parquet")  # as a push killed before its manifest leaves it
        fs.rm(f"{root}/store.json")
        read_back.clear()
        again = push(store.root, url)
        data_files = len(list(fmt.version_dir(store.root, "vae", 1).iterdir())) - 1  # all but the manifest
        assert again.copied == ["vae/v1"] and again.objects_sent == 1 and again.objects_skipped == data_files
        assert read_back == []
        # a CRC32C that differs is a different object: never skipped as present
        bad = _shards(store.root)[-1]
        key = f"{root}/vae/v1/{bad.name}"
        fs.rm([f"{root}/vae/v1/manifest.parquet", key])
        fs.pipe_file(key, bytes(len(bad.read_bytes())))  # the same size, other bytes
        with pytest.raises(UserError, match="differs|other contents"):
            push(store.root, url)
    finally:
        fs.rm(f"/h1-{tmp_path.name}", recursive=True)


def test_native_crc32c_reads_gcs_field_only() -> None:
    assert remote_mod.native_crc32c({"crc32c": "AAAAAA=="}) == "00000000"
    assert remote_mod.native_crc32c({"crc32c": "yZRlqg=="}) == "c99465aa"  # GCS's documented value of "hello world"
    assert remote_mod.native_crc32c({"size": 3}) is None and remote_mod.native_crc32c({"crc32c": "x"}) is None
