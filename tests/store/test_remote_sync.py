"""`pipeline store push|pull` against a real S3-protocol server (moto on 127.0.0.1, tests/s3_server.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pipeline.cli import app
from schemas.errors import UserError
from store import Store
from store import remote as remote_mod
from store.remote_pull import pull
from store.remote_push import push
from store.verify import verify_store
from transfer_gate import AfterN
from store_samples import fill, sample

runner = CliRunner()


def files_of(root: Path) -> dict[str, bytes]:
    """Every file of the store's complete versions and store.json (what a reader depends on)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)}


def objects(env) -> dict[str, int]:
    out = env.client().list_objects_v2(Bucket=env.bucket).get("Contents", [])
    return {o["Key"]: o["Size"] for o in out}


def two_version_store(store: Store) -> Store:
    fill(store, 10, tag="a")  # vae v1
    fill(store, 6, tag="b", start=20)  # vae v2, current
    return store


def test_push_then_pull_round_trips_the_store(s3_env, store: Store, tmp_path: Path) -> None:
    two_version_store(store)
    res = runner.invoke(app, ["store", "push", str(store.root), s3_env.url()])
    assert res.exit_code == 0, res.output
    assert "copied vae/v2" in res.output and "not sent vae/v1: not current" in res.output  # v1: gc's garbage
    keys = objects(s3_env)
    assert "store/vae/v2/manifest.parquet" in keys and "store/store.json" in keys
    assert not any(k.startswith("store/vae/v1/") for k in keys)

    dst = tmp_path / "pulled"
    res = runner.invoke(app, ["store", "pull", s3_env.url(), str(dst)])
    assert res.exit_code == 0, res.output
    # the same bytes, so the same checksums; the pulled store verifies and reads the same tensors
    assert files_of(dst) == {k: v for k, v in files_of(store.root).items() if not k.startswith("vae/v1/")}
    assert verify_store(dst) == []
    pulled = Store(dst, create=False)
    assert pulled.tables() == store.tables() == {"vae": 2}
    a, b = store.reader("vae"), pulled.reader("vae")
    for i in range(20, 26):
        key = sample(i)["key"]
        ta, tb = a.tensors(key), b.tensors(key)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    a.close(), b.close()

    # nothing new: a second push/pull sends nothing
    again = push(store.root, s3_env.url())
    assert again.copied == [] and again.objects_sent == 0 and again.present == ["vae/v2"], again
    assert pull(s3_env.url(), dst).objects_sent == 0


def test_killed_push_leaves_no_visible_version_and_a_rerun_sends_only_the_rest(s3_env, store: Store,
                                                                              monkeypatch) -> None:
    fill(store, 12)
    real_upload = remote_mod.Remote.upload

    def reset(*args):
        raise ConnectionResetError("connection reset by peer")

    gate = AfterN(3, real_upload, after=reset)  # the server goes away after 3 objects
    monkeypatch.setattr(remote_mod.Remote, "upload", lambda self, *a: gate(self, *a))
    res = runner.invoke(app, ["store", "push", str(store.root), s3_env.url()])
    assert res.exit_code == 1
    err = res.output.strip().splitlines()[-1]
    assert "lost the connection" in err and s3_env.url() in err and "rerun" in err
    after_kill = objects(s3_env)
    assert len(after_kill) == 3
    # no manifest, no store.json: no reader sees a version
    assert not any(k.endswith(("manifest.parquet", "store.json")) for k in after_kill)

    monkeypatch.setattr(remote_mod.Remote, "upload", real_upload)
    total = len(list((store.root / "vae" / "v1").iterdir()))
    summary = push(store.root, s3_env.url())
    assert summary.objects_skipped == 3 and summary.objects_sent == total - 3
    assert summary.copied == ["vae/v1"]


def test_corrupted_remote_object_is_refused_on_pull(s3_env, store: Store, tmp_path: Path) -> None:
    fill(store, 8)
    push(store.root, s3_env.url())
    client = s3_env.client()
    key = next(k for k in objects(s3_env) if k.endswith(".tar"))
    data = bytearray(client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=bytes(data))

    dst = tmp_path / "pulled"
    res = runner.invoke(app, ["store", "pull", s3_env.url(), str(dst)])
    assert res.exit_code == 1
    line = res.output.strip().splitlines()[-1]
    assert "damaged" in line and key.split("/", 1)[1] in line and "refused" in line
    assert Store(dst, create=False).versions("vae") == []  # nothing visible locally
    assert Store(dst, create=False).tables() == {}


def test_server_stopped_is_one_line(store: Store, monkeypatch, tmp_path: Path) -> None:
    from s3_server import aws_env, start_server

    fill(store, 4)
    server, endpoint = start_server()
    aws_env(monkeypatch, endpoint)
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="stopped-bucket")
    server.stop()
    for args in (["push", str(store.root), "s3://stopped-bucket/s"], ["pull", "s3://stopped-bucket/s",
                                                                       str(tmp_path / "x")]):
        res = runner.invoke(app, ["store", *args])
        assert res.exit_code == 1, res.output
        out = res.output.strip()
        assert "Traceback" not in out and len(out.splitlines()) == 1
        assert "lost the connection to s3://stopped-bucket/s" in out and "AWS_ENDPOINT_URL" in out


@pytest.mark.parametrize("endpoint", ["127.0.0.1:9000", "http://127.0.0.1:9000 "])
def test_a_malformed_endpoint_url_is_one_line(store: Store, monkeypatch, endpoint: str) -> None:
    """AWS_ENDPOINT_URL without its scheme, or with a trailing space (a copy-paste): botocore's ValueError
    ("Invalid endpoint") or EndpointResolutionError ended push, pull and inspect in a traceback. Now one line
    naming the variable."""
    from s3_server import aws_env

    fill(store, 2)
    aws_env(monkeypatch, endpoint)
    for args in (["push", str(store.root), "s3://some-bucket/s"], ["inspect", "s3://some-bucket/s"]):
        res = runner.invoke(app, ["store", *args])
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
        out = res.output.strip().splitlines()[-1]
        assert "is not a valid URL" in out and "check AWS_ENDPOINT_URL" in out and repr(endpoint) in out


def test_bad_credentials_and_missing_bucket_are_one_line(s3_env, store: Store, monkeypatch) -> None:
    fill(store, 4)
    res = runner.invoke(app, ["store", "push", str(store.root), "s3://no-such-bucket/store"])
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == [
        next(ln for ln in res.output.splitlines() if "does not exist" in ln)]
    assert "s3://no-such-bucket/store" in res.output

    import moto.settings
    from moto.core.responses import ActionAuthenticatorMixin

    # moto checks credentials only when told to: from now on every request must carry a known key
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    res = runner.invoke(app, ["store", "push", str(store.root), s3_env.url()])
    assert res.exit_code == 1
    out = res.output.strip()
    assert len(out.splitlines()) == 1 and "access to " + s3_env.url() + " denied" in out
    assert "AWS_ACCESS_KEY_ID" in out


def test_two_pushers_racing_for_one_version_never_both_commit(s3_env, tmp_path: Path, monkeypatch) -> None:
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    fill(a, 6, tag="a")
    fill(b, 6, tag="b", start=50)  # another store: its v1 holds other samples under the same object names
    push(a.root, s3_env.url())
    before = {k: s3_env.client().head_object(Bucket=s3_env.bucket, Key=k)["ETag"] for k in objects(s3_env)}
    # b listed the remote before a's push landed: it plans to upload all of its v1
    real_listing = remote_mod.Remote.listing
    calls = []

    def stale_first_listing(self, *args, **kwargs):
        calls.append(1)
        return {} if len(calls) == 1 else real_listing(self, *args, **kwargs)

    monkeypatch.setattr(remote_mod.Remote, "listing", stale_first_listing)
    with pytest.raises(UserError, match="differs between"):
        push(b.root, s3_env.url())
    # every object is a's, untouched: pulling gives a's store, intact
    assert {k: s3_env.client().head_object(Bucket=s3_env.bucket, Key=k)["ETag"] for k in objects(s3_env)} == before
    pulled = tmp_path / "pulled"
    pull(s3_env.url(), pulled)
    assert files_of(pulled) == files_of(a.root)
    assert verify_store(pulled) == []


def test_interrupted_pull_shows_nothing_and_a_rerun_fetches_only_the_rest(s3_env, store: Store, tmp_path: Path,
                                                                         monkeypatch) -> None:
    fill(store, 12)
    push(store.root, s3_env.url())
    real_download = remote_mod.Remote.download
    fetched: list[str] = []

    def failing_download(self, rel, local, progress):
        if len(fetched) == 4:
            raise ConnectionResetError("connection reset by peer")
        fetched.append(rel)
        return real_download(self, rel, local, progress)

    monkeypatch.setattr(remote_mod.Remote, "download", failing_download)
    dst = tmp_path / "pulled"
    with pytest.raises(UserError, match="lost the connection"):
        pull(s3_env.url(), dst)
    assert Store(dst, create=False).versions("vae") == [] and Store(dst, create=False).tables() == {}

    monkeypatch.setattr(remote_mod.Remote, "download", real_download)
    summary = pull(s3_env.url(), dst)
    n_files = len(list((store.root / "vae" / "v1").iterdir()))
    assert summary.objects_skipped == 4 and summary.objects_sent == n_files - 4
    assert files_of(dst) == files_of(store.root) and verify_store(dst) == []


def test_server_gone_mid_push_then_back_a_rerun_completes(store: Store, monkeypatch) -> None:
    """A real outage: the server stops after 3 objects (one line, no traceback), comes back on another port (moto
    keeps its objects in the process), and the rerun sends only what is missing."""
    from s3_server import aws_env, start_server

    fill(store, 12)
    server, endpoint = start_server()
    aws_env(monkeypatch, endpoint)
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="outage-bucket")
    real_upload = remote_mod.Remote.upload
    gate = AfterN(3, real_upload, then=server.stop)  # the server stops after 3 objects; later ones reach nothing
    monkeypatch.setattr(remote_mod.Remote, "upload", lambda self, *a: gate(self, *a))
    res = runner.invoke(app, ["store", "push", str(store.root), "s3://outage-bucket/s"])
    assert res.exit_code == 1
    assert "Traceback" not in res.output
    out = [ln for ln in res.output.splitlines() if ln.strip() and "push s3://" not in ln]  # + the progress bar
    assert len(out) == 1 and "lost the connection to s3://outage-bucket/s" in out[0] and "rerun" in out[0]

    monkeypatch.setattr(remote_mod.Remote, "upload", real_upload)
    server, endpoint = start_server()
    try:
        aws_env(monkeypatch, endpoint)
        summary = push(store.root, "s3://outage-bucket/s")
        n_files = len(list((store.root / "vae" / "v1").iterdir()))
        assert summary.objects_skipped == 3 and summary.objects_sent == n_files - 3
    finally:
        server.stop()


def test_server_gone_mid_pull_then_back_a_rerun_completes(store: Store, monkeypatch, tmp_path: Path) -> None:
    from s3_server import aws_env, start_server

    fill(store, 12)
    server, endpoint = start_server()
    aws_env(monkeypatch, endpoint)
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="outage-pull")
    push(store.root, "s3://outage-pull/s")
    real_download = remote_mod.Remote.download
    gate = AfterN(4, real_download, then=server.stop)
    monkeypatch.setattr(remote_mod.Remote, "download", lambda self, *a: gate(self, *a))
    dst = tmp_path / "pulled"
    res = runner.invoke(app, ["store", "pull", "s3://outage-pull/s", str(dst)])
    assert res.exit_code == 1 and "Traceback" not in res.output
    out = [ln for ln in res.output.splitlines() if ln.strip() and "pull s3://" not in ln]  # + the progress bar
    assert len(out) == 1 and "lost the connection to s3://outage-pull/s" in out[0]
    assert Store(dst, create=False).versions("vae") == []  # nothing half-fetched is visible

    monkeypatch.setattr(remote_mod.Remote, "download", real_download)
    server, endpoint = start_server()
    try:
        aws_env(monkeypatch, endpoint)
        summary = pull("s3://outage-pull/s", dst)
        assert summary.objects_skipped == 4 and summary.copied == ["vae/v1"]
        assert files_of(dst) == files_of(store.root) and verify_store(dst) == []
    finally:
        server.stop()


def test_a_push_never_rolls_the_remote_back_to_an_older_current_version(s3_env, store: Store, tmp_path: Path) -> None:
    """A store that has not seen the remote's newer version (another writer committed vae v2 there since this store
    pushed v1) pushes again: v2 stays current on the remote, and the summary says so."""
    fill(store, 4, tag="a")  # vae v1
    push(store.root, s3_env.url())
    other = tmp_path / "other"
    pull(s3_env.url(), other)
    fill(Store(other, create=False), 3, tag="b", start=20)  # vae v2 in another copy of the store
    push(other, s3_env.url())
    fill(store, 2, tag="c", start=40)  # v2 locally too, other content: a conflict, refused as before
    with pytest.raises(UserError, match="differs|conflict|grew apart"):
        push(store.root, s3_env.url())

    behind = tmp_path / "behind"
    shutil.copytree(other, behind)  # the URL's versions (a pull copies its current one alone: v1 is garbage there)
    Store(behind, create=False).set_current("vae", 1)  # a copy whose current is the older version
    summary = push(behind, s3_env.url())
    assert summary.newer == ["vae/v2"] and "kept the remote's newer current vae/v2" in str(summary)
    pulled = tmp_path / "check"
    pull(s3_env.url(), pulled)
    assert Store(pulled, create=False).tables() == {"vae": 2}


def test_a_later_stages_quarantine_rows_reach_the_remote(s3_env, store: Store, tmp_path: Path) -> None:
    """resize-bucket's rejections are pushed with its table; encode's, added later to the same store, are merged in
    by the next push (they used to stay local: the remote's quarantine.parquet was written only when absent)."""
    from store import quarantine

    fill(store, 4)
    quarantine.add_rows(store.root, [{"key": None, "source": "a.tar:x.jpg", "stage": "resize-bucket",
                                      "reason": "unreadable"}])
    push(store.root, s3_env.url())
    quarantine.add_rows(store.root, [{"key": sample(1)["key"], "source": "s", "stage": "encode-text",
                                      "reason": "caption too long"}])
    push(store.root, s3_env.url())
    push(store.root, s3_env.url())  # nothing new: no row twice
    pulled = tmp_path / "pulled"
    pull(s3_env.url(), pulled)
    assert sorted(quarantine.read(pulled).column("stage").to_pylist()) == ["encode-text", "resize-bucket"]


def test_pushing_back_a_cached_copy_that_added_nothing_lists_and_writes_nothing(s3_env, store: Store, tmp_path,
                                                                                 monkeypatch) -> None:
    """A stage of `run all` on a URL that found its table up to date pushes its cached copy back: every version
    there came from the remote. That push listed the whole prefix (~200k objects at 1M samples, per stage) and
    rewrote store.json; now it sends nothing and lists nothing."""
    from store.remote_cache import local_store

    fill(store, 6)
    push(store.root, s3_env.url())
    cached = local_store(s3_env.url(), ["vae"], tmp_path / "cache")
    before = {o["Key"]: o["ETag"] for o in s3_env.client().list_objects_v2(Bucket=s3_env.bucket)["Contents"]
              if "/.leases/" not in o["Key"]}
    monkeypatch.setattr(remote_mod.Remote, "listing", lambda *a, **k: pytest.fail("listed the prefix"))
    writes: list[str] = []
    real_pipe = remote_mod.Remote.write
    monkeypatch.setattr(remote_mod.Remote, "write", lambda self, rel, *a, **k: writes.append(rel) or
                        real_pipe(self, rel, *a, **k))
    swapped: list[tuple[str, bool]] = []  # (object, whether the compare-and-swap wrote it)
    real_swap = remote_mod.Remote.swap

    def swap(self, rel, update, *a, **k):
        def recorded(old):
            new = update(old)
            swapped.append((rel, new is not None))
            return new
        return real_swap(self, rel, recorded, *a, **k)

    monkeypatch.setattr(remote_mod.Remote, "swap", swap)
    summary = push(cached, s3_env.url())
    assert summary.present == ["vae/v1"] and not summary.copied and summary.objects_sent == 0
    after = {o["Key"]: o["ETag"] for o in s3_env.client().list_objects_v2(Bucket=s3_env.bucket)["Contents"]
             if "/.leases/" not in o["Key"]}
    assert after == before and not [w for w in writes if not w.startswith((".leases/", ".clock/"))]
    assert ("store.json", False) in swapped and ("store.json", True) not in swapped


def test_the_summary_of_a_pull_says_fetched_not_sent():
    """A pull's line said "0.5 MiB sent" about what it had downloaded."""
    from store.remote_sync import SyncSummary

    pull, push = SyncSummary("pull", "s3://b/p"), SyncSummary("push", "s3://b/p")
    assert "0 B fetched" in str(pull) and "sent" not in str(pull)
    assert "0 B sent" in str(push)


def test_push_and_pull_reach_the_server_by_the_endpoint_option_alone(s3_env, store: Store, tmp_path: Path,
                                                                     monkeypatch) -> None:
    """`-o endpoint_url=...` is the only way to the server here (no AWS_ENDPOINT_URL): every object push and pull
    touch - the lease, the listing, the objects, store.json's swap, the quarantine - goes through the options
    (a client opened from the URL alone would ask AWS itself and fail)."""
    from store import quarantine

    fill(store, 4)
    assert quarantine.add_rows(store.root, [{"key": "ab" * 16, "source": "src/m.jsonl:3", "stage": "resize-bucket",
                                             "reason": "too-small", "detail": "8x8"}]) == 1
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    option = ["-o", f"endpoint_url={s3_env.endpoint}"]
    r = runner.invoke(app, ["store", "push", str(store.root), s3_env.url(), *option])
    assert r.exit_code == 0, r.output
    pulled = tmp_path / "pulled"
    r = runner.invoke(app, ["store", "pull", s3_env.url(), str(pulled), *option])
    assert r.exit_code == 0, r.output
    assert verify_store(pulled) == [] and Store(pulled).reader("vae").keys() == store.reader("vae").keys()
    assert quarantine.read(pulled).column("key").to_pylist() == ["ab" * 16]


@pytest.mark.parametrize("whole", [False, True])
def test_a_lazy_open_with_an_endpoint_option_fetches_its_shards_through_it(s3_env, store: Store, tmp_path: Path,
                                                                          monkeypatch, whole: bool) -> None:
    """`local_store(url, ..., storage_options=...)` (the Python API; no CLI command passes -o there): the open
    used the options, but the shard fetches after it (a reader's range reads, a whole open's fetches) opened the URL
    from the environment alone and asked another server, here one that refuses connections."""
    from s3_server import unreachable_endpoint

    from store.remote_cache import local_store

    fill(store, 4)
    push(store.root, s3_env.url())
    with unreachable_endpoint() as nowhere:
        monkeypatch.setenv("AWS_ENDPOINT_URL", nowhere)  # the environment points elsewhere: only -o reaches it
        root = local_store(s3_env.url(), ["vae"], tmp_path / "cache", whole=whole,
                           storage_options={"endpoint_url": s3_env.endpoint})
        with Store(root, create=False).reader("vae") as cached, store.reader("vae") as local:
            for k in local.keys():
                got, want = cached.tensors(k), local.tensors(k)
                assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_conflict_on_a_version_completed_after_this_process_listed_it_is_not_named_incomplete(s3_env,
                                                                                                tmp_path) -> None:
    """A push's conflict on an object of a version another push completed meanwhile: the manifest is asked of the
    server, never of s3fs's cache of an earlier listing of the version in this process (which lacks it: the
    version was named incomplete, "gc removes it, then push again" - a gc never removes a complete version)."""
    from store.remote_sync import _conflict

    url = s3_env.url("completed")
    remote = remote_mod.open_remote(url)
    remote.write("vae/v1/schema.json", b"{}")
    assert list(remote.listing("vae/v1")) == ["vae/v1/schema.json"]  # listed: s3fs keeps the folder's listing
    s3_env.client().put_object(Bucket=s3_env.bucket, Key="completed/vae/v1/manifest.parquet", Body=b"m")
    why = str(_conflict("vae", 1, url, tmp_path / "local", remote))
    assert "differs between" in why and "incomplete" not in why, why
