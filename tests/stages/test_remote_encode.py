"""encode-text with `--store s3://...`: encoded in a local cached copy, then pushed back; the remote then holds the
same `text` table a local run writes, and a rerun says up to date without encoding again."""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from store.remote_pull import pull
from store.remote_push import push


def test_encode_text_on_a_store_url(s3_env, edit_store: Path, tiny_edit_model, tmp_path: Path) -> None:
    url = s3_env.url("enc")
    push(edit_store, url)
    args = ["run", "encode-text", "--model", tiny_edit_model, "--device", "cpu"]
    res = CliRunner().invoke(app, [*args, "--store", url, "--cache-dir", str(tmp_path / "cache")])
    assert res.exit_code == 0, res.output
    assert "copied text/v1" in res.output
    local = CliRunner().invoke(app, [*args, "--store", str(edit_store)])
    assert local.exit_code == 0, local.output

    pulled = tmp_path / "pulled"
    pull(url, pulled)
    a, b = Store(edit_store).reader("text"), Store(pulled, create=False).reader("text")
    assert sorted(a.keys()) == sorted(b.keys()) and a.keys()
    for key in a.keys():
        ta, tb = a.tensors(key), b.tensors(key)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    a.close(), b.close()

    # (default cache: under HOME, when XDG_CACHE_HOME is unset: the suite sets it, tests/conftest.py)
    again = CliRunner().invoke(app, [*args, "--store", url, "--json"],
                               env={"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": None})
    assert (tmp_path / "home" / ".cache" / "qwen-edit-pipeline" / "stores").is_dir()
    assert again.exit_code == 0, again.output
    assert '"encoded": 0' in again.output and "nothing new" in again.output


def test_a_rerun_whose_settings_match_an_older_complete_version_adopts_it_as_a_local_store_does(
        s3_env, edit_store: Path, tiny_edit_model, tmp_path: Path) -> None:
    """Our `text` v1 is complete on the remote; another writer's v2 (other settings) is current (we lost the
    race, or simply came second). Rerunning our settings must reuse v1 as a local store does (`find_version`: the
    newest complete version of the lineage; `adopt` makes it current), not encode every sample again into v3
    (hours at 1M samples): from a fresh cache (several nodes' caches drop their parts after the commit, a
    replaced node) and from the cache that wrote v1 (whose push used to keep v2 current)."""
    import json

    from store.checksum import unseal

    url = s3_env.url("race")
    push(edit_store, url)
    base = ["run", "encode-text", "--model", tiny_edit_model, "--device", "cpu", "--json"]
    ours, theirs = [], ["--set", "encode_text.batching=padded"]  # another lineage

    def run(store, settings, cache: str | None = None) -> dict:
        res = CliRunner().invoke(app, [*base, *settings, "--store", str(store),
                                       *(["--cache-dir", str(tmp_path / cache)] if cache else [])])
        assert res.exit_code == 0, res.output
        return json.JSONDecoder().raw_decode(res.output[res.output.index("{"):])[0]

    def current() -> int:
        body = s3_env.client().get_object(Bucket=s3_env.bucket, Key="race/store.json")["Body"].read()
        return unseal(body)["tables"]["text"]["current"]

    # the local twin: v1 ours, v2 theirs, our rerun makes v1 current again, encoding nothing
    assert run(edit_store, ours)["version"] == 1 and run(edit_store, theirs)["version"] == 2
    again = run(edit_store, ours)
    assert (again["version"], again["encoded"], Store(edit_store).tables()["text"]) == (1, 0, 1)

    assert run(url, ours, "node-a")["version"] == 1 and run(url, theirs, "node-b")["version"] == 2
    assert current() == 2
    fresh = run(url, ours, "node-c")  # no copy of v1 in this cache: the remote's is found
    assert (fresh["version"], fresh["encoded"], fresh["up_to_date"]) == (1, 0, True)
    assert current() == 1 == Store(edit_store).tables()["text"]
    assert not [o for o in s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix="race/text/v3/")
                .get("Contents", [])]
    back = run(url, theirs, "node-b")  # their cache holds v2: adopted there, made current here as well
    assert (back["version"], back["encoded"], current()) == (2, 0, 2)
    cached = run(url, ours, "node-a")  # our cache holds v1
    assert (cached["version"], cached["encoded"], current()) == (1, 0, 1)

    # a third lineage from a fresh cache, which opens only the current v1: its own next number, v2, is theirs on
    # the remote. It writes v3; before, it encoded every sample into v2 and its push was refused ("differs
    # between the cache and the remote", again from a fresh cache), its quarantine rows naming that number
    third = run(url, ["--set", "encode_text.dtype=bfloat16"], "node-d")
    assert (third["version"], third["encoded"], current()) == (3, len(Store(edit_store).reader("images")), 3)
