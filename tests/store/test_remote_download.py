"""A pull's download is one streamed GET per object, read a piece at a time (store/remote_download.py): s3fs's file
object fetched 8 MiB blocks (one GET each) and held a block, the piece and copies per transfer (~15 MiB; 16
transfers ~240 MiB measured, bench/store_transfer_memory.py). A body cut off mid-way resumes from the bytes already
received. Against the S3 test server (moto); no timing, no memory measured here."""

from __future__ import annotations

import os
from pathlib import Path

from remote_fakes import CutBody
from store import Store
from store import format as fmt
from store import remote as remote_mod
from store.remote_pull import pull
from store.remote_push import push
from store.verify import verify_store
from store_samples import sample, vae_schema

BIG = 3 * 2**20 + 12345  # a shard of over 3 MiB: several pieces of 1 MiB


def _store(root: Path) -> Store:
    store = Store(root)
    w = store.writer("vae", vae_schema(), shard_size_mb=0.004)
    for i in range(3):
        s = sample(i)
        w.add(s["key"], tensors=s["tensors"], files={"target.png": os.urandom(BIG)} if i == 0 else s["files"],
              meta=s["meta"])
    w.commit()
    return store


def test_a_pull_streams_each_object_in_one_get_and_resumes_a_cut_body(s3_env, tmp_path, monkeypatch) -> None:
    store = _store(tmp_path / "store")
    shard = sorted(fmt.version_dir(store.root, "vae", 1).glob("shard-*.tar"))[0]
    assert shard.stat().st_size > 3 * remote_mod.READ_PIECE
    push(store.root, s3_env.url())
    gets, cut, pieces = [], [], []
    real_open_remote = remote_mod.open_remote

    def recording_open_remote(*a, **kw):
        remote = real_open_remote(*a, **kw)
        real_call = remote.fs._call_s3

        async def call_s3(method, *args, **kwargs):
            out = await real_call(method, *args, **kwargs)
            if method == "get_object" and kwargs["Key"].endswith(shard.name):
                gets.append(kwargs.get("Range"))
                out["Body"] = CutBody(out["Body"], cut)
            return out

        remote.fs._call_s3 = call_s3
        return remote

    real_download = remote_mod.Remote.download

    def recording_download(self, rel, local, progress):
        class Bar:
            def update(self, n: int) -> None:
                pieces.append(n) if rel.endswith(shard.name) else None
                progress.update(n)
        return real_download(self, rel, local, Bar())

    monkeypatch.setattr("store.remote_pull.open_remote", recording_open_remote)
    monkeypatch.setattr(remote_mod.Remote, "download", recording_download)
    pulled = tmp_path / "pulled"
    summary = pull(s3_env.url(), pulled)
    assert summary.copied == ["vae/v1"]
    # one GET, cut once after its first piece, resumed from the bytes received (not from the start); before: one
    # ranged GET per 8 MiB block of s3fs's file object
    assert cut == [remote_mod.READ_PIECE] and gets == [None, f"bytes={remote_mod.READ_PIECE}-"]
    assert max(pieces) <= remote_mod.READ_PIECE and sum(pieces) == shard.stat().st_size
    assert (pulled / "vae" / "v1" / shard.name).read_bytes() == shard.read_bytes()
    assert verify_store(pulled) == []


def _pull_through(fault, s3_env, tmp_path, monkeypatch):
    """`pull` of the S3 test store through tests/store/fault_proxy.py answering with `fault`: (the pulled folder,
    the summary, the stopped proxy: its `faults`)."""
    from fault_proxy import FaultProxy

    proxy = FaultProxy(s3_env.endpoint, fault)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        pulled = tmp_path / "pulled"
        summary = pull(s3_env.url(), pulled)
    finally:
        proxy.stop()
    return pulled, summary, proxy


def test_a_body_really_cut_off_once_per_shard_resumes_and_the_pull_completes(s3_env, tmp_path, monkeypatch) -> None:
    """A real reset mid-body (tests/store/fault_proxy.py sends half of each shard's first GET, then closes the
    connection): the download resumes from the bytes received, every file checked, nothing refetched whole."""
    store = _store(tmp_path / "store")
    push(store.root, s3_env.url())
    cut: list[str] = []

    def fault(method: str, path: str):
        key = path.split("?")[0]
        if method == "GET" and key.endswith(".tar") and key not in cut:
            cut.append(key)
            return "cut"
        return None

    pulled, summary, proxy = _pull_through(fault, s3_env, tmp_path, monkeypatch)
    shards = sorted(fmt.version_dir(store.root, "vae", 1).glob("shard-*.tar"))
    assert summary.copied == ["vae/v1"] and len(cut) == len(shards) == len(proxy.faults)
    assert verify_store(pulled) == []
    assert [(pulled / "vae" / "v1" / p.name).read_bytes() for p in shards] == [p.read_bytes() for p in shards]


def test_a_cut_body_resumed_from_a_server_that_ignores_range_is_not_spliced(s3_env, tmp_path, monkeypatch) -> None:
    """The resume of a cut body asks `Range: bytes=N-`; a server (or proxy) that ignores Range answers with the whole
    object again, which was appended after the N bytes received: every shard cut once was refused as damaged.
    The first N bytes of that answer are skipped."""
    store = _store(tmp_path / "store")
    push(store.root, s3_env.url())
    cut: list[str] = []

    def fault(method: str, path: str):
        key = path.split("?")[0]
        if method != "GET" or not key.endswith(".tar"):
            return None
        if key not in cut:
            cut.append(key)
            return "cut"
        return "norange"

    pulled, summary, proxy = _pull_through(fault, s3_env, tmp_path, monkeypatch)
    shards = sorted(fmt.version_dir(store.root, "vae", 1).glob("shard-*.tar"))
    # (a cut before any byte arrived resumes from 0, with no Range to ignore)
    assert summary.copied == ["vae/v1"] and any(how == "norange" for how, *_ in proxy.faults), proxy.faults
    assert verify_store(pulled) == []
    assert [(pulled / "vae" / "v1" / p.name).read_bytes() for p in shards] == [p.read_bytes() for p in shards]
