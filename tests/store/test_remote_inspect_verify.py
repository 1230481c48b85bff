"""`pipeline store inspect|verify s3://...` against the S3 test server: inspect says what a local inspect of the same
store says (from the metadata alone: no shard is fetched); verify opens every version in the cache, fetches each shard
checked, and reports a damaged object on the remote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from store.remote_sync import push
from store_samples import fill

runner = CliRunner()


def _two_versions(store: Store) -> Store:
    fill(store, 10, tag="a")
    fill(store, 6, tag="b", start=20)
    return store


def test_inspect_of_a_url_matches_the_local_store_and_fetches_no_shard(s3_env, store: Store, monkeypatch) -> None:
    from store import remote as remote_mod

    _two_versions(store)
    push(store.root, s3_env.url())
    read: list[str] = []
    real_read = remote_mod.Remote.read
    monkeypatch.setattr(remote_mod.Remote, "read", lambda self, rel: read.append(rel) or real_read(self, rel))
    monkeypatch.setattr(remote_mod.Remote, "download", lambda *a: pytest.fail("inspect downloaded a file"))
    remote = runner.invoke(app, ["store", "inspect", s3_env.url(), "--json"])
    assert remote.exit_code == 0, remote.output
    local = runner.invoke(app, ["store", "inspect", str(store.root), "--json"])
    assert local.exit_code == 0, local.output
    a, b = json.loads(remote.output), json.loads(local.output)
    assert a.pop("store") == s3_env.url() and b.pop("store") == str(store.root)
    assert a == b and [v["samples"] for v in a["tables"]["vae"]["versions"]] == [10, 6]
    assert read and not any(r.endswith(".tar") for r in read)

    text = runner.invoke(app, ["store", "inspect", s3_env.url()])
    assert text.exit_code == 0 and "vae" in text.output


def test_verify_of_a_url_checks_every_version_through_the_cache(s3_env, store: Store, tmp_path: Path) -> None:
    _two_versions(store)
    push(store.root, s3_env.url())
    cache = tmp_path / "cache"
    res = runner.invoke(app, ["store", "verify", s3_env.url(), "--cache-dir", str(cache)])
    assert res.exit_code == 0, res.output
    assert f"ok: {s3_env.url()} verified" in res.output
    (cached,) = [p for p in cache.iterdir() if p.is_dir()]
    assert Store(cached, create=False).versions("vae") == [1, 2]  # both versions opened, not only the current

    # a flipped byte in a shard of v1 on the server: verify (into a fresh cache) names it and exits 1
    client = s3_env.client()
    key = next(o["Key"] for o in client.list_objects_v2(Bucket=s3_env.bucket)["Contents"]
               if o["Key"].startswith("store/vae/v1/") and o["Key"].endswith(".tar"))
    data = bytearray(client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=bytes(data))
    res = runner.invoke(app, ["store", "verify", s3_env.url(), "--cache-dir", str(tmp_path / "fresh")])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "damaged" in res.output and key.split("/", 1)[1] in res.output


def test_inspect_and_verify_of_an_empty_prefix_are_one_line(s3_env, tmp_path: Path) -> None:
    for args in (["inspect", s3_env.url("nothing")],
                 ["verify", s3_env.url("nothing"), "--cache-dir", str(tmp_path / "c")]):
        res = runner.invoke(app, ["store", *args])
        assert res.exit_code == 1 and "Traceback" not in res.output
        assert f"no store at {s3_env.url('nothing')}" in res.output
