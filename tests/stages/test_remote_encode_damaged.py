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

from damage import damaged_on_server, lose_current
from pipeline.cli import app
from store import Store, remote_pull, remote_shards
from store.checksum import unseal
from store.remote_pull import pull
from store.verify import verify_store


def _objects(s3_env, prefix: str) -> dict[str, str]:
    """{key: ETag} under `prefix`."""
    listed = s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: o["ETag"] for o in listed}


SKIP = ("--set", "encode_text.on_damaged=skip", "--set", "encode_text.max_damaged_fraction=0.5")


def _encode_text(model: str, url: str, cache: Path, *settings: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["run", "encode-text", "--model", model, "--device", "cpu", "--json", *settings,
                                   "--store", url, "--cache-dir", str(cache)])
    return res.exit_code, res.output


def _summary(out: str) -> dict:
    return json.JSONDecoder().raw_decode(out[out.index("{"):])[0]


def test_a_version_that_skipped_a_damaged_input_complete_on_the_remote_is_not_adopted_under_stop(
        s3_env, edit_store: Path, tiny_edit_model, tmp_path: Path, monkeypatch) -> None:
    url, keys, key, repair = damaged_on_server(s3_env, edit_store, "dmg")
    client, bucket = s3_env.client(), s3_env.bucket

    def run(cache: str, *settings: str) -> tuple[int, str]:
        return _encode_text(tiny_edit_model, url, tmp_path / cache, *settings)

    code, out = run("node-a", *SKIP)
    assert code == 0, out
    rec = _summary(out)
    assert (rec["version"], rec["damaged_inputs"]) == (1, [key])
    lose_current(s3_env, "dmg", "text")  # its store.json swap lost: v1 complete on the remote, not current
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

    repair()
    monkeypatch.setattr(remote_shards, "_fetchers", {})  # a new process: no range kept from the damaged bytes
    code, out = run("node-a")  # resumes the version its stopped run opened, v1's other samples carried forward
    assert code == 0, out
    rec = _summary(out)
    assert (rec["up_to_date"], rec["version"], rec["encoded"], rec["reused"] + rec["resumed"]) == \
        (False, 2, 1, len(keys) - 1)  # a new number: v1 on the remote is another version
    assert _objects(s3_env, "dmg/text/v1/") == v1  # untouched
    assert unseal(client.get_object(Bucket=bucket, Key="dmg/store.json")["Body"].read())["tables"]["text"] == \
        {"current": 2}
    pulled = tmp_path / "pulled"
    pull(url, pulled)
    assert sorted(Store(pulled).reader("text").keys()) == sorted(keys)
    code, out = run("node-a")
    assert code == 0 and _summary(out)["up_to_date"] and _summary(out)["version"] == 2, out


@pytest.mark.parametrize("rows_cached", [True, False])
def test_a_fresh_cache_refusing_the_remotes_version_carries_its_samples_forward(
        s3_env, edit_store: Path, tiny_edit_model, tmp_path: Path, monkeypatch, rows_cached: bool) -> None:
    """The remote's v1 (skip, one damaged sample left out, its store.json swap lost) refused under stop by a fresh
    cache, which holds no copy of it: the new version carries v1's samples forward (v1 opened in the cache, as a
    local store's rerun carries them from its own copy) and encodes only the repaired one. Before, the line said
    it carried them forward and every sample was encoded again. Not `rows_cached` (the remote's rows merged there
    after the cache's open pulled them): the copy now in the cache, which its rows do not show refused, is not
    adopted either by the writer's second look (output._completed_meanwhile)."""
    url, keys, key, repair = damaged_on_server(s3_env, edit_store, "fresh")
    code, out = _encode_text(tiny_edit_model, url, tmp_path / "node-a", *SKIP)
    assert code == 0, out
    lose_current(s3_env, "fresh", "text")  # its store.json swap lost
    v1 = _objects(s3_env, "fresh/text/v1/")
    repair()
    monkeypatch.setattr(remote_shards, "_fetchers", {})  # a new process: no range kept from the damaged bytes

    if not rows_cached:
        monkeypatch.setattr(remote_pull, "pull_quarantine", lambda *a, **k: 0)
    code, out = _encode_text(tiny_edit_model, url, tmp_path / "node-b")  # a fresh cache, on_damaged=stop
    assert code == 0, out
    assert out.count("left out 1 damaged input sample(s)") == 1 and "carries its samples forward" in out, out
    rec = _summary(out)
    assert (rec["up_to_date"], rec["version"], rec["encoded"], rec["reused"]) == (False, 2, 1, len(keys) - 1), rec
    assert _objects(s3_env, "fresh/text/v1/") == v1  # untouched
    pulled = tmp_path / "pulled"
    pull(url, pulled)
    assert sorted(Store(pulled).reader("text").keys()) == sorted(keys)
    assert verify_store(pulled, progress=False) == []
