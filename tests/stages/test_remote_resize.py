"""`pipeline run resize-bucket --store s3://...` against the S3 test server: written in the local cache, then
pushed; the remote's `images` table is the one a local run writes (same samples, same bytes per sample), and a rerun
is up to date without rendering or sending anything."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.demo_data import make_demo_data
from store import Store
from store.remote_sync import pull


ARGS = ["--area", "4096", "--multiple", "32", "--val-fraction", "0.25", "--workers", "0"]


def test_resize_bucket_on_a_store_url(s3_env, tmp_path: Path) -> None:
    data = tmp_path / "data"
    make_demo_data(data, n=6, fmt="folder", max_controls=1, seed=3)
    url, cache = s3_env.url("rb"), tmp_path / "cache"
    cmd = ["run", "resize-bucket", "--source", str(data), *ARGS]
    res = CliRunner().invoke(app, [*cmd, "--store", url, "--cache-dir", str(cache)])
    assert res.exit_code == 0, res.output
    assert "copied images/v1" in res.output
    local = CliRunner().invoke(app, [*cmd, "--store", str(tmp_path / "local")])
    assert local.exit_code == 0, local.output

    pulled = tmp_path / "pulled"
    pull(url, pulled)
    a, b = Store(tmp_path / "local", create=False).reader("images"), Store(pulled, create=False).reader("images")
    assert sorted(a.keys()) == sorted(b.keys()) and len(a.keys()) == 6
    for key in a.keys():
        assert a.files(key) == b.files(key)
    a.close(), b.close()

    again = CliRunner().invoke(app, [*cmd, "--store", url, "--cache-dir", str(cache), "--json"])
    assert again.exit_code == 0, again.output
    assert '"up_to_date": true' in again.stdout and "nothing new" in again.stderr
