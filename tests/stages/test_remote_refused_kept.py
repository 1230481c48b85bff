"""A store URL's version refused under on_damaged=stop stays refused on the next run of the same cache. The
remote's v1 (made under skip, one damaged sample left out, its store.json swap lost) is refused by a cache that
was opened before v1's quarantine rows reached the remote (a warm open does not pull them), through the remote's
rows (nodes.writer_place), and opened in that cache to carry from; the run stops on the still damaged sample.
Before, that cache's next run found the copy there, judged it by its own rows (none), called the table up to date
and made v1 current on the remote: the version it had refused, its sample still left out."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from damage import damaged_on_server, lose_current
from pipeline.cli import app
from store.checksum import unseal
from store.remote_cache import local_store

SKIP = ("--set", "encode_text.on_damaged=skip", "--set", "encode_text.max_damaged_fraction=0.5")


def _encode_text(model: str, url: str, cache: Path, *settings: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["run", "encode-text", "--model", model, "--device", "cpu", *settings,
                                   "--store", url, "--cache-dir", str(cache)])
    return res.exit_code, res.output


def test_a_refused_version_in_a_cache_is_not_adopted_by_its_next_run(s3_env, edit_store: Path, tiny_edit_model,
                                                                     tmp_path: Path) -> None:
    url, keys, key, _repair = damaged_on_server(s3_env, edit_store, "kept")
    local_store(url, ["images"], tmp_path / "node-b")  # node b's cache, opened before any quarantine row
    code, out = _encode_text(tiny_edit_model, url, tmp_path / "node-a", *SKIP)
    assert code == 0, out
    lose_current(s3_env, "kept", "text")  # v1 complete on the remote, not current; its rows there

    for attempt in range(2):  # the sample is still damaged: each run under stop reads it again and stops
        code, out = _encode_text(tiny_edit_model, url, tmp_path / "node-b")
        assert code == 1 and key in out and "is up to date" not in out, (attempt, out)
        record = unseal(s3_env.client().get_object(Bucket=s3_env.bucket, Key="kept/store.json")["Body"].read())
        assert "text" not in record["tables"], (attempt, record)  # v1 never made current
