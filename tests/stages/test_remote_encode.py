"""encode-text with `--store s3://...`: encoded in a local cached copy, then pushed back; the remote then holds the
same `text` table a local run writes, and a rerun says up to date without encoding again."""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from store.remote_sync import pull, push


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
