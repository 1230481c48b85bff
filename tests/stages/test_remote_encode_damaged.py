"""encode-text on a store URL (the S3 test server), its `images` sample damaged on the remote: a version made under
on_damaged=skip, which left that sample out, complete on the remote but not current there (its store.json swap
lost), is not adopted by a rerun under stop (as a local store's rerun does not reuse it, test_damage_rerun.py):
the rerun reads the sample again, stops while it is damaged, encodes it once repaired, and writes a new version
whose number is clear of the remote's, which stays untouched."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from damage import sample_byte
from pipeline.cli import app
from store import Store, remote_shards, remote_sync
from store.checksum import seal, unseal
from store.remote_sync import pull, push
from store.verify import verify_store


def _objects(s3_env, prefix: str) -> dict[str, str]:
    """{key: ETag} under `prefix`."""
    listed = s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: o["ETag"] for o in listed}


def test_a_version_that_skipped_a_damaged_input_complete_on_the_remote_is_not_adopted_under_stop(
        s3_env, edit_store: Path, tiny_edit_model, tmp_path: Path, monkeypatch) -> None:
    url, client, bucket = s3_env.url("dmg"), s3_env.client(), s3_env.bucket
    push(edit_store, url)
    keys = Store(edit_store).reader("images").keys()
    key = sorted(keys)[1]
    shard, pos = sample_byte(edit_store, "images", key, "target.png")
    rel = f"dmg/images/v1/{shard.name}"
    clean = client.get_object(Bucket=bucket, Key=rel)["Body"].read()
    bad = bytearray(clean)
    bad[pos] ^= 1 << 4
    client.put_object(Bucket=bucket, Key=rel, Body=bytes(bad))  # damaged on the server: read by range, each checked

    def run(cache: str, *settings: str) -> tuple[int, str]:
        res = CliRunner().invoke(app, ["run", "encode-text", "--model", tiny_edit_model, "--device", "cpu", "--json",
                                       *settings, "--store", url, "--cache-dir", str(tmp_path / cache)])
        return res.exit_code, res.output

    def summary(out: str) -> dict:
        return json.JSONDecoder().raw_decode(out[out.index("{"):])[0]

    code, out = run("node-a", "--set", "encode_text.on_damaged=skip", "--set", "encode_text.max_damaged_fraction=0.5")
    assert code == 0, out
    rec = summary(out)
    assert (rec["version"], rec["damaged_inputs"]) == (1, [key])
    # its store.json swap lost: v1 complete on the remote, not current
    record = unseal(client.get_object(Bucket=bucket, Key="dmg/store.json")["Body"].read())
    del record["tables"]["text"]
    client.put_object(Bucket=bucket, Key="dmg/store.json", Body=seal(record))
    v1 = _objects(s3_env, "dmg/text/v1/")
    assert "dmg/text/v1/manifest.parquet" in v1

    for cache in ("node-b", "node-a"):  # a fresh cache (no copy of v1), and the one that wrote v1
        code, out = run(cache)  # on_damaged=stop (the default): the left-out sample stops the run
        assert code == 1 and "Traceback" not in out, out
        assert "is up to date" not in out and key in out and "table 'images' v1" in out, out
        assert "text" not in unseal(client.get_object(Bucket=bucket, Key="dmg/store.json")["Body"].read())["tables"]
        assert out.count("left out 1 damaged input sample(s)") == 1, out  # said once
    # the fresh cache opened its version at a number clear of the remote's v1 (its push must not meet v1 there),
    # and v1 as the remote's copy, to carry from
    root = tmp_path / "node-b" / hashlib.sha256(url.encode()).hexdigest()[:16]  # store/remote_cache.local_store
    assert sorted(p.name for p in (root / "text").glob("v*")) == ["v1", "v2"]
    assert remote_shards.is_lazy(root / "text" / "v1") and not remote_shards.is_lazy(root / "text" / "v2")

    client.put_object(Bucket=bucket, Key=rel, Body=clean)  # repaired
    monkeypatch.setattr(remote_shards, "_fetchers", {})  # a new process: no range kept from the damaged bytes
    code, out = run("node-a")  # resumes the version its stopped run opened, v1's other samples carried forward
    assert code == 0, out
    rec = summary(out)
    assert (rec["up_to_date"], rec["version"], rec["encoded"], rec["reused"] + rec["resumed"]) == \
        (False, 2, 1, len(keys) - 1)  # a new number: v1 on the remote is another version
    assert _objects(s3_env, "dmg/text/v1/") == v1  # untouched
    assert unseal(client.get_object(Bucket=bucket, Key="dmg/store.json")["Body"].read())["tables"]["text"] == \
        {"current": 2}
    pulled = tmp_path / "pulled"
    pull(url, pulled)
    assert sorted(Store(pulled).reader("text").keys()) == sorted(keys)
    code, out = run("node-a")
    assert code == 0 and summary(out)["up_to_date"] and summary(out)["version"] == 2, out


@pytest.mark.parametrize("rows_cached", [True, False])
def test_a_fresh_cache_refusing_the_remotes_version_carries_its_samples_forward(
        s3_env, edit_store: Path, tiny_edit_model, tmp_path: Path, monkeypatch, rows_cached: bool) -> None:
    """The remote's v1 (skip, one damaged sample left out, its store.json swap lost) refused under stop by a fresh
    cache, which holds no copy of it: the new version carries v1's samples forward (v1 opened in the cache, as a
    local store's rerun carries them from its own copy) and encodes only the repaired one. Before, the line said
    it carried them forward and every sample was encoded again. Not `rows_cached` (the remote's rows merged there
    after the cache's open pulled them): the copy now in the cache, which its rows do not show refused, is not
    adopted either by the writer's second look (output._completed_meanwhile)."""
    url, client, bucket = s3_env.url("fresh"), s3_env.client(), s3_env.bucket
    push(edit_store, url)
    keys = Store(edit_store).reader("images").keys()
    key = sorted(keys)[1]
    shard, pos = sample_byte(edit_store, "images", key, "target.png")
    rel = f"fresh/images/v1/{shard.name}"
    clean = client.get_object(Bucket=bucket, Key=rel)["Body"].read()
    bad = bytearray(clean)
    bad[pos] ^= 1 << 4
    client.put_object(Bucket=bucket, Key=rel, Body=bytes(bad))

    def run(cache: str, *settings: str) -> tuple[int, str]:
        res = CliRunner().invoke(app, ["run", "encode-text", "--model", tiny_edit_model, "--device", "cpu", "--json",
                                       *settings, "--store", url, "--cache-dir", str(tmp_path / cache)])
        return res.exit_code, res.output

    code, out = run("node-a", "--set", "encode_text.on_damaged=skip", "--set", "encode_text.max_damaged_fraction=0.5")
    assert code == 0, out
    record = unseal(client.get_object(Bucket=bucket, Key="fresh/store.json")["Body"].read())
    del record["tables"]["text"]  # its store.json swap lost
    client.put_object(Bucket=bucket, Key="fresh/store.json", Body=seal(record))
    v1 = _objects(s3_env, "fresh/text/v1/")
    client.put_object(Bucket=bucket, Key=rel, Body=clean)  # repaired
    monkeypatch.setattr(remote_shards, "_fetchers", {})  # a new process: no range kept from the damaged bytes

    if not rows_cached:
        monkeypatch.setattr(remote_sync, "pull_quarantine", lambda *a, **k: 0)
    code, out = run("node-b")  # a fresh cache, on_damaged=stop
    assert code == 0, out
    assert out.count("left out 1 damaged input sample(s)") == 1 and "carries its samples forward" in out, out
    rec = json.JSONDecoder().raw_decode(out[out.index("{"):])[0]
    assert (rec["up_to_date"], rec["version"], rec["encoded"], rec["reused"]) == (False, 2, 1, len(keys) - 1), rec
    assert _objects(s3_env, "fresh/text/v1/") == v1  # untouched
    pulled = tmp_path / "pulled"
    pull(url, pulled)
    assert sorted(Store(pulled).reader("text").keys()) == sorted(keys)
    assert verify_store(pulled, progress=False) == []
