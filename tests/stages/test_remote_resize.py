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


def test_a_rerun_whose_settings_match_an_older_complete_version_makes_it_current_at_the_url_too(
        s3_env, tmp_path: Path) -> None:
    """Our `images` v1 is complete on the remote; another run's v2 (other settings) is current. Rerunning our
    settings in the cache holding v1 reuses it, as a local store's rerun does (`find_version` + `set_current`), and
    must make it current on the remote too: before, only the cache's current moved, the push after it never moves
    the remote's back, and the run said v1 while the remote (every other node, the next stage) kept v2."""
    import json

    from store.checksum import unseal

    data = tmp_path / "data"
    make_demo_data(data, n=6, fmt="folder", max_controls=1, seed=3)
    ours, theirs = ["--val-fraction", "0.25"], ["--val-fraction", "0.5"]  # another lineage
    url = s3_env.url("race")

    def run(store, settings, cache: str | None = None) -> dict:
        res = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(data), *ARGS, *settings, "--json",
                                       "--store", str(store),
                                       *(["--cache-dir", str(tmp_path / cache)] if cache else [])])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    def current() -> int:
        body = s3_env.client().get_object(Bucket=s3_env.bucket, Key="race/store.json")["Body"].read()
        return unseal(body)["tables"]["images"]["current"]

    # the local twin: v1 ours, v2 theirs, our rerun makes v1 current again, rendering nothing
    local = tmp_path / "local"
    assert run(local, ours)["version"] == 1 and run(local, theirs)["version"] == 2
    again = run(local, ours)
    assert (again["version"], again["up_to_date"], Store(local).tables()["images"]) == (1, True, 1)

    assert run(url, ours, "node-a")["version"] == 1 and run(url, theirs, "node-b")["version"] == 2
    assert current() == 2
    cached = run(url, ours, "node-a")  # this cache holds v1 (pushed, so a copy of the remote's)
    assert (cached["version"], cached["up_to_date"], current()) == (1, True, 1)
    back = run(url, theirs, "node-b")
    assert (back["version"], back["up_to_date"], current()) == (2, True, 2)
    assert not s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix="race/images/v3/").get("Contents")
