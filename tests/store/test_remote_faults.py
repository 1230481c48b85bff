"""Faults of a store URL against the S3 test server: a `pipeline store push` process SIGKILLed half-way leaves no
visible version and its rerun completes; the server stopped in the middle of a file while the cache pulls leaves
nothing half-written in the cache, and the pull completes once the server is back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from schemas.errors import UserError
from store import Store
from store import format as fmt
from store import remote as remote_mod
from store.remote_sync import pull, push
from store.verify import verify_store
from store_samples import fill

pytest.importorskip("s3fs", reason="a store URL needs the s3 extra")

# `pipeline store push` in a child process that stops (sleeps) after 3 objects, once it has said so in a file: the
# test then SIGKILLs it, at a known point and without any timing assumption
STALLING_PUSH = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from store import remote

    real, sent = remote.Remote.upload, []

    def upload(self, *args, **kwargs):
        if len(sent) == 3:
            Path(sys.argv[3]).write_text("3 sent")
            time.sleep(3600)
        out = real(self, *args, **kwargs)
        sent.append(args[1])
        return out

    remote.Remote.upload = upload
    from pipeline.cli import app
    app(["store", "push", sys.argv[1], sys.argv[2]])
""")


def _keys(env) -> list[str]:
    return [o["Key"] for o in env.client().list_objects_v2(Bucket=env.bucket).get("Contents", [])]


def test_sigkilled_push_leaves_no_visible_version_and_a_rerun_completes(s3_env, store: Store,
                                                                       tmp_path: Path) -> None:
    fill(store, 12)
    marker = tmp_path / "stalled"
    child = subprocess.Popen([sys.executable, "-c", STALLING_PUSH, str(store.root), s3_env.url(), str(marker)],
                             env=dict(os.environ), start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300  # a generous bound for a loaded machine, not a timing assertion
        while not marker.exists():
            assert child.poll() is None, "the push ended before it stalled"
            assert time.monotonic() < deadline, "the push never reached its 4th object"
            time.sleep(0.05)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    keys = _keys(s3_env)
    # the killed push's lease object stays behind (no atexit after SIGKILL): gc judges it dead (its pid is gone)
    leases = [k for k in keys if "/.leases/" in k]
    assert len(leases) == 1 and json.loads(s3_env.client().get_object(
        Bucket=s3_env.bucket, Key=leases[0])["Body"].read())["versions"] == {"vae": [1]}
    keys = [k for k in keys if k not in leases]
    assert len(keys) == 3 and not any(k.endswith(fmt.MANIFEST) or k.endswith(fmt.STORE_JSON) for k in keys)
    with pytest.raises(UserError, match="no store at"):  # nothing visible: not even a store
        pull(s3_env.url(), tmp_path / "early")

    summary = push(store.root, s3_env.url())
    assert summary.copied == ["vae/v1"] and summary.objects_skipped == 3
    pulled = tmp_path / "pulled"
    pull(s3_env.url(), pulled)
    assert verify_store(pulled) == [] and Store(pulled, create=False).tables() == {"vae": 1}


def test_server_stopped_mid_file_leaves_nothing_half_written_in_the_cache(store: Store, monkeypatch,
                                                                         tmp_path: Path) -> None:
    from s3_server import aws_env, start_server
    from store.remote_cache import local_store

    fill(store, 12, shard_size_mb=0.02)
    server, endpoint = start_server()
    aws_env(monkeypatch, endpoint)
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="outage-cache")
    push(store.root, "s3://outage-cache/s")
    monkeypatch.setattr(remote_mod, "CHUNK", 4096)  # every file read in several ranged requests
    real_download = remote_mod.Remote.download
    files: list[str] = []

    received: list[int] = []  # bytes of the file cut short that arrived

    class StopAfterFirstChunk:
        """The progress bar of the first shard: the server goes away once its first chunk has arrived."""

        def __init__(self, bar) -> None:
            self.bar = bar

        def update(self, n: int) -> None:
            self.bar.update(n)
            received.append(n)
            if server_running:
                server.stop()
                server_running.clear()

    server_running = [True]

    def download(self, rel, local, progress):
        files.append(rel)
        if rel.endswith(".tar") and server_running:
            progress = StopAfterFirstChunk(progress)
        return real_download(self, rel, local, progress)

    monkeypatch.setattr(remote_mod.Remote, "download", download)
    cache = tmp_path / "cache"
    with pytest.raises(UserError, match="lost the connection to s3://outage-cache/s"):
        local_store("s3://outage-cache/s", ["vae"], cache)
    assert not server_running and files[-1].endswith(".tar")
    assert 0 < sum(received) < (store.root / files[-1]).stat().st_size  # cut off in the middle of the file
    (root,) = [p for p in cache.iterdir() if p.is_dir()]
    assert not list(root.rglob("*.part"))  # the file cut short was removed
    assert Store(root, create=False).versions("vae") == []  # and no version is visible
    for p in root.rglob("*"):  # what is kept of the interrupted pull is whole, checked files only
        if p.is_file() and p.parent.name.endswith(".pull"):
            assert p.read_bytes() == (store.root / "vae" / "v1" / p.name).read_bytes()

    monkeypatch.setattr(remote_mod.Remote, "download", real_download)
    server, endpoint = start_server()
    try:
        aws_env(monkeypatch, endpoint)
        assert Store(local_store("s3://outage-cache/s", ["vae"], cache), create=False).versions("vae") == [1]
        assert verify_store(root) == []
    finally:
        server.stop()
