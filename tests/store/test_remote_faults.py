"""Faults of a store URL against the S3 test server: a `pipeline store push` process SIGKILLed half-way leaves no
visible version and its rerun completes; a connection lost in the middle of a shard a reader fetches leaves
nothing half-written in the cache, and the read completes once the server answers whole again."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from schemas.errors import UserError
from store import Store
from store import format as fmt
from store.remote_pull import pull
from store.remote_push import push
from store.verify import verify_store
from stalled_push import push_killed_where_it_stalls
from store_samples import fill


# `pipeline store push` in a child process that stops (sleeps) after 3 objects, once it has said so in a file: the
# test then SIGKILLs it, at a known point and without any timing assumption (stalled_push.py)
STALLING_PUSH = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from store import remote
    from transfer_gate import AfterN

    gate = AfterN(3, remote.Remote.upload, then=lambda: Path(sys.argv[3]).write_text("3 sent"),
                  after=lambda *a: time.sleep(3600))
    remote.Remote.upload = lambda self, *a, **k: gate(self, *a, **k)
    from pipeline.cli import app
    app(["store", "push", sys.argv[1], sys.argv[2]])
""")


def _keys(env) -> list[str]:
    return [o["Key"] for o in env.client().list_objects_v2(Bucket=env.bucket).get("Contents", [])]


def test_sigkilled_push_leaves_no_visible_version_and_a_rerun_completes(s3_env, store: Store,
                                                                       tmp_path: Path) -> None:
    fill(store, 12)
    push_killed_where_it_stalls(STALLING_PUSH, store.root, s3_env.url(), tmp_path / "stalled", "its 4th object")
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


def test_a_connection_lost_mid_file_leaves_nothing_half_written_in_the_cache(s3_env, store: Store, monkeypatch,
                                                                           tmp_path: Path) -> None:
    """The connection is reset in the middle of a shard a reader's scan fetches whole (one streamed GET, its
    Range resumes cut too, till the retries are spent): one line naming the URL, no partial file under any name a
    reader opens, and once the server answers whole again the read completes, every file checked. (A proxy in
    front of the test server cuts every shard GET's body half-way; stopping the server did not cut a streamed body
    already sent.)"""
    from fault_proxy import FaultProxy
    from store import remote_shards
    from store.remote_cache import local_store

    fill(store, 12, shard_size_mb=0.02)
    push(store.root, s3_env.url())
    mode: list[str | None] = [None]
    gets: list[str] = []  # every shard GET's path

    def fault(method: str, path: str) -> str | None:
        if method != "GET" or ".tar" not in path:
            return None
        gets.append(path)
        return mode[0]

    proxy = FaultProxy(s3_env.endpoint, fault)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        cache = tmp_path / "cache"
        root = local_store(s3_env.url(), ["vae"], cache)  # metadata only
        monkeypatch.setattr(remote_shards, "WHOLE_AFTER", 0)  # the first read of a shard fetches it whole
        mode[0] = "cut"
        with Store(root, create=False).reader("vae") as r:
            first = r.shard_groups()[0]
            with pytest.raises(UserError, match=f"lost the connection to {s3_env.url()}"):
                r.tensors(first[0])
        assert sum(how == "cut" for how, *_ in proxy.faults) > 1  # the first GET and its Range resumes
        shard = r.view.samples.shard_of(r.row_of(first[0]))
        vdir = fmt.version_dir(root, "vae", 1)
        assert not (vdir / shard).exists()  # nothing half-written under the shard's name
        assert not [p for p in root.rglob("*") if p.suffix == ".part"
                    or (remote_shards.FETCH_TAG in p.name and not p.name.endswith(remote_shards.RANGED))]

        mode[0] = None
        gets.clear()
        # a shard of many blocks (s3fs's file object read 8 MiB blocks, one GET each: 32 for a 256 MB shard; the
        # block made small here): one streamed GET all the same
        monkeypatch.setattr(remote_shards, "CHUNK", 4096, raising=False)
        with Store(local_store(s3_env.url(), ["vae"], cache), create=False).reader("vae") as r:
            for k in first:
                r.tensors(k)
        assert len([g for g in gets if shard in g]) == 1
        assert (vdir / shard).read_bytes() == (store.root / "vae" / "v1" / shard).read_bytes()
        assert verify_store(root) == []  # the other shards fetched (and checked) by verify
    finally:
        proxy.stop()


def test_a_server_that_accepts_and_never_answers_is_one_line_after_two_tries_of_s3fs(monkeypatch) -> None:
    """An endpoint that accepts connections and never answers (a blackholing proxy): each request attempt waits
    s3fs's read timeout (15 s), botocore tries AWS_MAX_ATTEMPTS times, and s3fs's own loop tried all that 5 times
    over: with the default 5 attempts, 25 tries and over 6 minutes of silence per request before the one line.
    Now s3fs tries twice: the line comes after 2 x AWS_MAX_ATTEMPTS connections (one attempt each here)."""
    from s3_server import aws_env, silent_endpoint
    from store.remote import open_remote, remote_errors

    with silent_endpoint() as (endpoint, accepted):
        aws_env(monkeypatch, endpoint)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        url = "s3://bucket/store"
        # read_timeout of 1 s: the test waits seconds, not 15 s a try (the count of tries is what is checked)
        remote = open_remote(url, {"config_kwargs": {"read_timeout": 1}})
        with pytest.raises(UserError, match=f"inspect: lost the connection to {url} \\(ReadTimeoutError"):
            with remote_errors(url, "inspect"):
                remote.listing()
        assert len(accepted) == 2
