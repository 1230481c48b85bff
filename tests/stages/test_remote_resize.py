"""`pipeline run resize-bucket --store s3://...` against the S3 test server: written in the local cache, then
pushed; the remote's `images` table is the one a local run writes (same samples, same bytes per sample), and a rerun
is up to date without rendering or sending anything."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.demo_data import make_demo_data
from store import Store
from store.remote_pull import pull


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


def _runner(tmp_path: Path, data: Path):
    import json

    def run(store, settings, cache: str) -> dict:
        res = CliRunner().invoke(app, ["run", "resize-bucket", "--source", str(data), *ARGS, *settings, "--json",
                                       "--store", str(store), "--cache-dir", str(tmp_path / cache)])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)

    return run


def _remote_current(s3_env, prefix: str) -> int:
    from store.checksum import unseal

    body = s3_env.client().get_object(Bucket=s3_env.bucket, Key=f"{prefix}/store.json")["Body"].read()
    return unseal(body)["tables"]["images"]["current"]


# A's pictures and B's differ (another bucket area): nothing of v2 can be carried forward into A's version
A, B = ["--area", "4096"], ["--area", "9216"]


def test_a_fresh_cache_rerunning_the_settings_of_an_older_complete_version_adopts_it_from_the_url(
        s3_env, tmp_path: Path) -> None:
    """Settings A -> v1, settings B -> v2 (current), settings A again on another machine (an empty cache folder,
    which opens only the remote's current v2): v1 is found on the remote (one listing) and made current there and
    in the cache, rendering nothing. Before, the cache's `find_version` saw no version of A's lineage and every
    image was rendered again into v3 (hours at 1M images)."""
    import hashlib

    from store.remote_cache import local_store
    from store.remote_shards import fetch_stats

    data = tmp_path / "data"
    make_demo_data(data, n=6, fmt="folder", max_controls=1, seed=3)
    url, run = s3_env.url("fresh"), _runner(tmp_path, data)
    assert run(url, A, "node-a")["version"] == 1
    first = tmp_path / "first"
    pull(url, first)
    assert run(url, B, "node-b")["version"] == 2 and _remote_current(s3_env, "fresh") == 2

    fetched = fetch_stats()["shard_bytes"] + fetch_stats()["range_bytes"]
    again = run(url, A, "node-c")  # a fresh cache: only v2 opened there
    assert (again["version"], again["up_to_date"], again["encoded"], again["reused"]) == (1, True, 0, 6)
    assert fetch_stats()["shard_bytes"] + fetch_stats()["range_bytes"] == fetched  # v1's metadata only
    assert again["newer_current"] is None
    assert _remote_current(s3_env, "fresh") == 1
    cached = tmp_path / "node-c" / hashlib.sha256(url.encode()).hexdigest()[:16]  # store/remote_cache.local_store
    assert Store(cached, create=False).tables()["images"] == 1
    assert not s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix="fresh/images/v3/").get("Contents")

    # a fresh reader of the URL reads v1: the first run's rows
    reader = Store(local_store(url, ["images"], tmp_path / "reader"), create=False)
    a, b = Store(first, create=False).reader("images", 1), reader.reader("images")
    assert b.version == 1 and sorted(a.keys()) == sorted(b.keys()) and len(a.keys()) == 6
    for key in a.keys():
        assert a.files(key) == b.files(key) and a.meta(key) == b.meta(key)
    a.close(), b.close()


def test_a_version_retired_by_store_repair_is_not_adopted_from_the_url(s3_env, tmp_path: Path) -> None:
    """v1 (settings A) carries the marker `store repair` leaves on a version it retires (here before the repair
    deleted its manifest, as a killed repair leaves it): a fresh cache rerunning A renders A's samples into a new
    version, never makes the retired one current again."""
    data = tmp_path / "data"
    make_demo_data(data, n=6, fmt="folder", max_controls=1, seed=3)
    url, run = s3_env.url("retired"), _runner(tmp_path, data)
    assert run(url, A, "node-a")["version"] == 1 and run(url, B, "node-b")["version"] == 2
    s3_env.client().put_object(Bucket=s3_env.bucket, Key="retired/images/v1.damaged.json", Body=b'{"keys": []}')

    again = run(url, A, "node-c")
    assert (again["version"], again["up_to_date"], again["encoded"]) == (3, False, 6)
    assert _remote_current(s3_env, "retired") == 3
