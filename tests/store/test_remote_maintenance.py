"""`store repair|gc URL`, `migrate v1-to-v2 URL`, read leases on the remote and the leftovers of killed pushes,
against the S3 test server (moto on 127.0.0.1, tests/s3_server.py; no mock inside the process)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from store import remote as remote_mod
from store import remote_lease
from store.integrity import write_version_checksums
from schemas.host import host_id
from store.lease import _pid_namespace
from store.remote import open_remote
from store.remote_cache import local_store
from store.remote_pull import pull
from store.remote_push import push
from store.verify import verify_store
from store_samples import fill
from transfer_gate import AfterN
import warm_start

runner = CliRunner()


def _cli(*args):
    r = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    return r


def objects(env) -> dict[str, int]:
    out = env.client().list_objects_v2(Bucket=env.bucket).get("Contents", [])
    return {o["Key"]: o["Size"] for o in out}


def remote_current(env) -> dict[str, int]:
    data = json.loads(env.client().get_object(Bucket=env.bucket, Key="store/store.json")["Body"].read())
    return {t: e["current"] for t, e in data["tables"].items()}


def test_repair_of_a_url_gives_a_current_version_that_verify_and_a_reader_use(s3_env, store: Store,
                                                                              tmp_path: Path, monkeypatch) -> None:
    fill(store, 6)
    before = {k: store.reader("vae").get(k)["tensors"] for k in store.reader("vae").keys()}
    push(store.root, s3_env.url())
    client = s3_env.client()
    key = sorted(k for k in objects(s3_env) if k.endswith(".tar"))[0]
    data = client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read()
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=data + os.urandom(700))  # bytes appended on the remote
    assert _cli("store", "verify", s3_env.url(), "--cache-dir", tmp_path / "c0").exit_code == 1

    listed: list[str] = []
    real_listing_times = remote_mod.Remote.listing_times
    monkeypatch.setattr(remote_mod.Remote, "listing_times",
                        lambda self, under="": listed.append(under) or real_listing_times(self, under))
    r = _cli("store", "repair", s3_env.url(), "--cache-dir", tmp_path / "work")
    assert r.exit_code == 0 and "bytes appended" in r.output and "retired" in r.output, r.output
    assert "" not in listed  # retiring v1 looks at the leases only, not at the whole prefix again
    assert remote_current(s3_env) == {"vae": 2}
    keys = objects(s3_env)
    assert "store/vae/v1/manifest.parquet" not in keys and "store/vae/v1.damaged.json" in keys
    assert not (tmp_path / "work" / ".work").exists() or not any((tmp_path / "work" / ".work").iterdir())
    r = _cli("store", "verify", s3_env.url(), "--cache-dir", tmp_path / "c1")
    assert r.exit_code == 0, r.output

    root = local_store(s3_env.url(), ["vae"], tmp_path / "c2", lease=False)
    reader = Store(root, create=False).reader("vae")
    assert reader.version == 2 and sorted(reader.keys()) == sorted(before)
    for k, tensors in before.items():
        got = reader.get(k)["tensors"]
        assert all(torch.equal(got[n], t) for n, t in tensors.items())
    reader.close()

    # the retired version's leftover objects go with the next gc (no grace: repair marked it)
    assert _cli("store", "gc", s3_env.url()).exit_code == 0
    assert not any(k.startswith("store/vae/v1/") or k.endswith("v1.damaged.json") for k in objects(s3_env))


def test_repair_of_a_url_fetches_only_the_current_versions_shards(s3_env, store: Store, tmp_path: Path,
                                                                    monkeypatch) -> None:
    """Repair scans each table's current version: only its shards cross the network (before, every complete
    version was pulled whole: terabytes for a large store's history). The other versions' metadata is enough to
    number the new version above every one the remote holds (v3 here, not current)."""
    for n, tag, start in ((8, "a", 0), (6, "b", 20), (4, "c", 40)):  # v2 made current below; v3 switched away from
        fill(store, n, tag=tag, start=start)  # each pushed while current (a superseded one is not pushed at all)
        push(store.root, s3_env.url())
    from store.remote_parts import make_current

    assert make_current(open_remote(s3_env.url()), "vae", 2, over=3) == 2
    client = s3_env.client()
    key = sorted(k for k in objects(s3_env) if k.startswith("store/vae/v2/") and k.endswith(".tar"))[0]
    data = client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read()
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=data + b"appended")
    fetched: list[str] = []
    real = remote_mod.Remote.download
    monkeypatch.setattr(remote_mod.Remote, "download",
                        lambda self, rel, local, progress: fetched.append(rel) or real(self, rel, local, progress))

    r = _cli("store", "repair", s3_env.url(), "--cache-dir", tmp_path / "work")
    assert r.exit_code == 0 and "retired" in r.output, r.output
    shards = {rel.split("/")[1] for rel in fetched if rel.endswith(".tar")}
    assert shards == {"v2"}, sorted(fetched)
    assert remote_current(s3_env) == {"vae": 4}  # above v3
    assert _cli("store", "verify", s3_env.url(), "--cache-dir", tmp_path / "c1").exit_code == 0


def _pushed_with_a_grown_shard(store: Store, s3_env) -> None:
    """6 samples pushed; then the first shard object on the server gets bytes appended (damaged, v1)."""
    fill(store, 6)
    push(store.root, s3_env.url())
    client = s3_env.client()
    key = sorted(k for k in objects(s3_env) if k.endswith(".tar"))[0]
    data = client.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read()
    client.put_object(Bucket=s3_env.bucket, Key=key, Body=data + b"appended")


KILLED_REPAIR = "import sys; from pipeline.cli import app; app(['store', 'repair', sys.argv[1], '--cache-dir', sys.argv[2]])"


@pytest.mark.parametrize("point", ["push_before_manifest", "repair_before_retire"])
def test_a_killed_repair_of_a_url_shows_nothing_half_done_and_its_rerun_finishes(s3_env, store: Store,
                                                                              tmp_path: Path, point: str) -> None:
    _pushed_with_a_grown_shard(store, s3_env)
    work = tmp_path / "work"
    # started warm (tests/warm_start.py: pipeline.cli imports torch, ~9 s of CPU cold); killed by its own SIGKILL
    killed = warm_start.run([sys.executable, "-c", KILLED_REPAIR, s3_env.url(), str(work)],
                            env={**os.environ, "STORE_CRASH_AT": point}, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    keys = objects(s3_env)
    if point == "push_before_manifest":  # the new version is not there, the old one is still current
        assert remote_current(s3_env) == {"vae": 1} and "store/vae/v2/manifest.parquet" not in keys
    else:  # the new version is current, the damaged one not yet retired
        assert remote_current(s3_env) == {"vae": 2} and "store/vae/v1/manifest.parquet" in keys
    assert "store/vae/v1.damaged.json" not in keys

    r = _cli("store", "repair", s3_env.url(), "--cache-dir", work)
    assert r.exit_code == 0 and "retired" in r.output, r.output
    keys = objects(s3_env)
    assert remote_current(s3_env) == {"vae": 2} and "store/vae/v1.damaged.json" in keys
    assert "store/vae/v1/manifest.parquet" not in keys and "store/vae/v3/manifest.parquet" not in keys
    assert _cli("store", "verify", s3_env.url(), "--cache-dir", tmp_path / "c1").exit_code == 0


def test_a_damaged_version_a_reader_holds_stays_marked_until_gc(s3_env, store: Store, tmp_path: Path) -> None:
    _pushed_with_a_grown_shard(store, s3_env)
    reader = remote_lease.hold(open_remote(s3_env.url()), [("vae", 1)], "pipeline train")  # a training on v1
    try:
        r = _cli("store", "repair", s3_env.url(), "--cache-dir", tmp_path / "work")
        assert r.exit_code == 0 and "is still read by pipeline train" in r.output, r.output
        keys = objects(s3_env)
        assert "store/vae/v1/manifest.parquet" in keys and "store/vae/v1.damaged.json" in keys
        assert remote_current(s3_env) == {"vae": 2}
        # marked: verify (every version) and pull skip it, so the store verifies
        assert _cli("store", "verify", s3_env.url(), "--cache-dir", tmp_path / "c1").exit_code == 0
        assert pull(s3_env.url(), tmp_path / "pulled").copied == ["vae/v2"]
        r = _cli("store", "inspect", s3_env.url(), "--json")
        assert [v["version"] for v in json.loads(r.stdout)["tables"]["vae"]["versions"]] == [2], r.output
        r = _cli("store", "gc", s3_env.url())
        assert r.exit_code == 0 and "keep vae/v1: not current, but held by pipeline train" in r.output, r.output
    finally:
        reader.release()
    assert _cli("store", "gc", s3_env.url()).exit_code == 0
    assert not any(k.startswith("store/vae/v1") for k in objects(s3_env))


def test_a_reader_whose_version_gc_removed_before_its_lease_is_told(s3_env, store: Store, tmp_path: Path,
                                                                    monkeypatch) -> None:
    """The race gc and an opening reader can have: the reader read store.json (v1 current) and pulled v1; before
    its lease is written, v2 is pushed and gc removes v1. The reader's check after its lease PUT says so."""
    from store.remote_gc import collect

    fill(store, 4)
    push(store.root, s3_env.url())
    real_hold = remote_lease.hold

    def gc_first(remote, versions, what, kind="read", **how):
        if kind == "push":  # the push below
            return real_hold(remote, versions, what, kind, **how)
        fill(store, 4, tag="b", start=10)
        push(store.root, s3_env.url())
        collect(s3_env.url(), echo=lambda line: None)
        return real_hold(remote, versions, what, kind, **how)

    monkeypatch.setattr(remote_lease, "hold", gc_first)
    import pytest
    from schemas.errors import UserError

    with pytest.raises(UserError, match="vae v1 was removed .* rerun"):
        local_store(s3_env.url(), ["vae"], tmp_path / "cache")
    monkeypatch.setattr(remote_lease, "hold", real_hold)
    assert not any("/.leases/" in k for k in objects(s3_env))  # its lease went with the error
    assert Store(local_store(s3_env.url(), ["vae"], tmp_path / "cache", lease=False)).reader("vae").version == 2


def test_migrate_of_a_url_makes_a_v2_version_current(s3_env, tmp_path: Path) -> None:
    from test_v1_handwritten import SAMPLES, write_v1_store

    root = tmp_path / "v1store"
    write_v1_store(root)
    vdir = root / "vae" / "v1"
    manifest_bytes = (vdir / "manifest.parquet").read_bytes()
    write_version_checksums(vdir, pq.read_table(vdir / "manifest.parquet"), manifest_bytes)  # pushable
    push(root, s3_env.url())

    r = _cli("migrate", "v1-to-v2", s3_env.url(), "--cache-dir", tmp_path / "work")
    assert r.exit_code == 0 and "v1 (schema v1) -> v2 (schema v2)" in r.output, r.output
    assert remote_current(s3_env) == {"vae": 2}
    assert _cli("store", "verify", s3_env.url(), "--cache-dir", tmp_path / "c1").exit_code == 0
    reader = Store(local_store(s3_env.url(), ["vae"], tmp_path / "c2", lease=False), create=False).reader("vae")
    assert reader.schema.schema_version == 2 and reader.schema.attrs["migrated_from"] == 1
    assert sorted(reader.keys()) == sorted(k for k, *_ in SAMPLES)
    reader.close()
    again = _cli("migrate", "v1-to-v2", s3_env.url(), "--cache-dir", tmp_path / "work")
    assert again.exit_code == 0 and "nothing to do" in again.output


def _stale_lease(s3_env, versions: dict[str, list[int]]) -> str:
    """A lease object of a process of this host that is gone (no such pid): dead at once."""
    rel = f"store/.leases/{socket.gethostname()}-999999999-dead.json"
    record = {"host": socket.gethostname(), "boot_id": host_id(), "pid": 999999999, "pid_start": 1,
              "pid_namespace": _pid_namespace(),
              "what": "pipeline train", "versions": versions, "kind": "read"}
    s3_env.client().put_object(Bucket=s3_env.bucket, Key=rel, Body=json.dumps(record).encode())
    return rel


def test_gc_of_a_url_keeps_current_and_leased_versions(s3_env, store: Store, tmp_path: Path) -> None:
    fill(store, 4, tag="a")  # v1
    push(store.root, s3_env.url())
    local_store(s3_env.url(), ["vae"], tmp_path / "cache")  # a reader of v1: its lease object names v1
    fill(store, 4, tag="b", start=10)  # v2
    push(store.root, s3_env.url())  # while current (a superseded version is not pushed)
    fill(store, 4, tag="c", start=20)  # v3, current
    push(store.root, s3_env.url())
    dead = _stale_lease(s3_env, {"vae": [2]})  # a killed reader's lease on v2 must not keep it
    leases = [k for k in objects(s3_env) if "/.leases/" in k]
    assert len(leases) == 2 and dead in leases

    before = objects(s3_env)
    r = _cli("store", "gc", s3_env.url(), "--dry-run")
    assert r.exit_code == 0 and "would remove vae/v2" in r.output and "keep vae/v1" in r.output, r.output
    assert objects(s3_env) == before  # a dry run deletes nothing

    r = _cli("store", "gc", s3_env.url())
    assert r.exit_code == 0, r.output
    keys = objects(s3_env)
    assert not any(k.startswith("store/vae/v2/") for k in keys) and dead not in keys
    assert "store/vae/v1/manifest.parquet" in keys and "store/vae/v3/manifest.parquet" in keys
    assert pull(s3_env.url(), tmp_path / "pulled").copied == ["vae/v1", "vae/v3"]
    assert verify_store(tmp_path / "pulled") == []

    remote_lease._held.pop(s3_env.url()).release()  # the reader is done: its lease object goes
    assert not any("/.leases/" in k for k in objects(s3_env))
    assert _cli("store", "gc", s3_env.url()).exit_code == 0
    keys = objects(s3_env)
    assert not any(k.startswith("store/vae/v1/") for k in keys) and "store/vae/v3/manifest.parquet" in keys


def test_gc_of_a_url_removes_a_losing_racers_objects_from_the_winners_version(s3_env, store: Store,
                                                                              tmp_path: Path) -> None:
    """Two pushes of different stores into one empty prefix: the loser's write-once shards stayed inside the
    winner's v1, which `store verify` reported for ever ("not listed in checksums.json", pointing at repair) and no
    gc removed. gc removes such objects once older than --incomplete-after; younger, they are kept."""
    from store.remote_verify import verify_url

    fill(store, 4)
    push(store.root, s3_env.url())
    client, listed = s3_env.client(), objects(s3_env)
    for name in ("shard-r00-000007.tar", "shard-r00-000007.index.parquet"):  # as the racer left them
        client.put_object(Bucket=s3_env.bucket, Key=f"store/vae/v1/{name}", Body=b"the other store's bytes")
    problems, _ = verify_url(s3_env.url(), progress=False)
    assert len(problems) == 2 and all("not listed in checksums.json" in p for p in problems), problems

    r = _cli("store", "gc", s3_env.url())  # young: a push may still be writing (kept)
    assert r.exit_code == 0 and "does not list" not in r.output and len(objects(s3_env)) == len(listed) + 2
    r = _cli("store", "gc", s3_env.url(), "--incomplete-after", "0")
    assert r.exit_code == 0 and "remove 2 object(s) in kept versions" in r.output, r.output
    assert objects(s3_env) == listed
    assert verify_url(s3_env.url(), progress=False)[0] == []
    assert pull(s3_env.url(), tmp_path / "pulled").copied == ["vae/v1"] and verify_store(tmp_path / "pulled") == []


def test_gc_of_many_old_versions_lists_the_whole_prefix_once(s3_env, store: Store, monkeypatch) -> None:
    """Right before each version's DELETE gc looks again for leases naming it: that look lists `.leases/` only.
    It listed the whole prefix (~40k objects a version at 1M samples) once per removed version."""
    for i, tag in enumerate("abcd"):  # v1..v3 old, v4 current
        fill(store, 2, tag=tag, start=10 * i)
        push(store.root, s3_env.url())  # each while current (a superseded version is not pushed)
    listed: list[str] = []
    real = remote_mod.Remote.listing_times
    monkeypatch.setattr(remote_mod.Remote, "listing_times",
                        lambda self, under="": listed.append(under) or real(self, under))
    r = _cli("store", "gc", s3_env.url())
    assert r.exit_code == 0 and "3 version(s) removed" in r.output, r.output
    # per version: the look before its manifest DELETE, and the look after it (a lease taken in between)
    assert listed.count("") == 1 and listed.count(remote_lease.LEASES_DIR) == 6, listed
    assert [k for k in objects(s3_env) if k.endswith("manifest.parquet")] == ["store/vae/v4/manifest.parquet"]


def _push_killed_after_three_objects(store: Store, s3_env, monkeypatch) -> None:
    """12 samples in `store`, pushed by a push whose connection dies after 3 objects of v1 (exit 1)."""
    fill(store, 12)
    real_upload = remote_mod.Remote.upload

    def reset(*args):
        raise ConnectionResetError("connection reset by peer")

    gate = AfterN(3, real_upload, after=reset)
    monkeypatch.setattr(remote_mod.Remote, "upload", lambda self, *a: gate(self, *a))
    assert _cli("store", "push", store.root, s3_env.url()).exit_code == 1
    monkeypatch.setattr(remote_mod.Remote, "upload", real_upload)


def test_a_killed_push_of_another_store_blocks_until_gc_removes_it(s3_env, store: Store, tmp_path: Path,
                                                                  monkeypatch) -> None:
    _push_killed_after_three_objects(store, s3_env, monkeypatch)
    assert not any("/.leases/" in k for k in objects(s3_env))  # the push lease went with the failed push

    other = Store(tmp_path / "other")
    fill(other, 5, tag="b", start=40)  # its own v1, other contents
    r = _cli("store", "push", other.root, s3_env.url())
    assert r.exit_code == 1 and "incomplete version" in r.output and f"pipeline store gc {s3_env.url()}" in r.output

    # within the grace period the leftovers are kept (a push may still be writing them)
    r = _cli("store", "gc", s3_env.url())
    assert r.exit_code == 0 and "keep vae/v1: incomplete" in r.output, r.output
    r = _cli("store", "gc", s3_env.url(), "--incomplete-after", "0")
    assert r.exit_code == 0 and "remove vae/v1 (incomplete" in r.output, r.output
    assert not any(k.startswith("store/vae/") for k in objects(s3_env))

    r = _cli("store", "push", other.root, s3_env.url())
    assert r.exit_code == 0 and "copied vae/v1" in r.output, r.output
    pulled = tmp_path / "pulled"
    pull(s3_env.url(), pulled)
    assert verify_store(pulled) == [] and sorted(Store(pulled).reader("vae").keys()) == sorted(
        Store(other.root).reader("vae").keys())


def test_a_live_push_lease_keeps_its_incomplete_version(s3_env, store: Store) -> None:
    fill(store, 4)
    push(store.root, s3_env.url())
    remote = open_remote(s3_env.url())
    s3_env.client().put_object(Bucket=s3_env.bucket, Key="store/vae/v2/shard-r00-000000.tar", Body=b"x" * 10)
    lease = remote_lease.hold(remote, [("vae", 2)], "push", kind="push")
    try:
        r = _cli("store", "gc", s3_env.url(), "--incomplete-after", "0")
        assert r.exit_code == 0 and "keep vae/v2: not current, but held by push" in r.output, r.output
        assert "store/vae/v2/shard-r00-000000.tar" in objects(s3_env)
    finally:
        lease.release()


def test_a_replacing_push_never_undoes_a_newer_current_version(s3_env, store: Store, tmp_path: Path) -> None:
    """repair / migrate on a URL publish with `replacing`: store.json changes only if the table is still at the
    version they replaced (a writer that committed meanwhile wins; the command says to rerun)."""
    import pytest
    from schemas.errors import UserError

    fill(store, 4)
    push(store.root, s3_env.url())
    fill(store, 4, tag="b", start=10)
    push(store.root, s3_env.url())  # remote current: v2
    copy = tmp_path / "copy"
    shutil.copytree(store.root, copy)  # the URL's versions (a pull copies v2 alone: v1 is garbage there)
    Store(copy).set_current("vae", 1)  # a working copy that still thinks v1 is current
    with pytest.raises(UserError, match="'vae' became v2 while this command replaced v1"):
        push(copy, s3_env.url(), replacing={"vae": 1})
    assert remote_current(s3_env) == {"vae": 2}


def test_a_resumed_push_refills_what_a_gc_removed_after_its_listing(s3_env, store: Store, tmp_path: Path,
                                                                    monkeypatch) -> None:
    """A gc that took a killed push's leftovers as stale right after the rerun listed them (the rerun skipped them
    as present): the rerun sends them again before its manifest, so the version it commits is whole."""
    _push_killed_after_three_objects(store, s3_env, monkeypatch)
    leftovers = [k for k in objects(s3_env) if k.startswith("store/vae/v1/")]
    assert len(leftovers) == 3

    gc_ran: list[bool] = []
    real_upload = remote_mod.Remote.upload

    def gc_then_upload(self, local, rel, crc, progress, *nbytes):
        if not gc_ran:  # the push planned (it skipped them): now a gc removes them, once
            gc_ran.append(True)
            for key in leftovers:
                s3_env.client().delete_object(Bucket=s3_env.bucket, Key=key)
        return real_upload(self, local, rel, crc, progress, *nbytes)

    monkeypatch.setattr(remote_mod.Remote, "upload", gc_then_upload)
    summary = push(store.root, s3_env.url())
    monkeypatch.setattr(remote_mod.Remote, "upload", real_upload)
    assert summary.objects_skipped == 3 and summary.copied == ["vae/v1"]
    assert all(k in objects(s3_env) for k in leftovers)
    pulled = tmp_path / "pulled"
    pull(s3_env.url(), pulled)
    assert verify_store(pulled) == []


def test_gc_judges_ages_by_the_servers_clock_not_this_machines(s3_env, store: Store, monkeypatch) -> None:
    """This machine's clock two hours ahead of the server's: a lease another node refreshed a moment ago and a
    push's objects written a moment ago are young by the server's LastModified; judged by the local clock, gc
    deleted the version that node reads and the push in progress. A clock probe left by a killed command goes."""
    import time as real_time
    import types

    from store import lease as local_lease, remote_gc

    fill(store, 4, tag="a")  # v1
    push(store.root, s3_env.url())  # while current (a superseded version is not pushed)
    fill(store, 4, tag="b", start=10)  # v2, current
    push(store.root, s3_env.url())
    client = s3_env.client()
    record = {"host": "another-node", "pid": 4242, "pid_start": 1, "pid_namespace": "x", "what": "pipeline train",
              "versions": {"vae": [1]}, "kind": "read"}  # refreshed just now by a reader on another machine
    client.put_object(Bucket=s3_env.bucket, Key="store/.leases/another-node-4242-abcd.json",
                      Body=json.dumps(record).encode())
    client.put_object(Bucket=s3_env.bucket, Key="store/vae/v3/shard-r00-000000.tar", Body=b"x" * 10)  # a push now
    probe = "store/.clock/dead-host-1-0000"
    client.put_object(Bucket=s3_env.bucket, Key=probe, Body=b"")

    ahead = types.SimpleNamespace(**{**vars(real_time), "time": lambda: real_time.time() + 7200})
    for module in (remote_mod, remote_gc, local_lease):
        monkeypatch.setattr(module, "time", ahead, raising=False)
    r = _cli("store", "gc", s3_env.url())
    assert r.exit_code == 0, r.output
    keys = objects(s3_env)
    assert "store/vae/v1/manifest.parquet" in keys and "keep vae/v1: not current, but held by" in r.output
    assert "store/vae/v3/shard-r00-000000.tar" in keys and "keep vae/v3: incomplete" in r.output, r.output
    assert "store/.leases/another-node-4242-abcd.json" in keys
    assert probe in keys and not any(k.startswith("store/.clock/") and k != probe for k in keys)  # its own removed

    r = _cli("store", "gc", s3_env.url(), "--incomplete-after", "0")  # an old probe goes with the leftovers
    assert r.exit_code == 0 and "1 leftover(s) of killed commands" in r.output, r.output
    assert probe not in objects(s3_env)


def test_the_clock_probe_is_one_put_per_command_not_one_per_lease_listing(s3_env, store: Store, monkeypatch) -> None:
    """The server's clock is measured once per opened remote (`Remote.now`): a gc lists the leases at its plan, before
    each manifest DELETE and after it, and a reader's heartbeat looks at its lease's age every minute - one probe
    PUT each, not one per listing or beat (at 8 nodes x 8 ranks a PUT per look would be billed writes)."""
    from store.remote import CLOCK_DIR

    probes: list[str] = []
    real = remote_mod.Remote.write
    monkeypatch.setattr(remote_mod.Remote, "write", lambda self, rel, data, *a, **k: (
        probes.append(rel) if rel.startswith(CLOCK_DIR + "/") else None) or real(self, rel, data, *a, **k))
    for tag in "abc":  # v1, v2 not current: two versions for gc to remove
        fill(store, 4, tag=tag)
        push(store.root, s3_env.url())
    held = remote_lease.hold_reading(s3_env.url(), [("vae", 3)])
    try:
        for _ in range(3):
            assert held._beat()
        assert len(probes) == 1
        r = _cli("store", "gc", s3_env.url(), "--incomplete-after", "0")
        assert r.exit_code == 0 and "2 version(s) removed" in r.output, r.output
        assert len(probes) == 2
    finally:
        remote_lease.release_all()


def test_gc_dry_run_with_read_only_credentials_reports_the_plan(s3_env, store: Store, monkeypatch) -> None:
    """A dry run writes nothing the user asked for; with a key that may only read (what one hands out to look),
    the clock probe of Remote.now is refused: the plan is still reported (on this machine's clock, said so)."""
    import s3fs

    fill(store, 4, tag="a")  # v1
    push(store.root, s3_env.url())  # while current (a superseded version is not pushed)
    fill(store, 4, tag="b", start=10)  # v2, current
    push(store.root, s3_env.url())
    before = objects(s3_env)

    async def denied(self, path, *args, **kwargs):
        raise PermissionError(f"Access Denied: PutObject {path}")

    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", denied)
    r = _cli("store", "gc", s3_env.url(), "--dry-run")
    assert r.exit_code == 0 and "would remove vae/v1" in r.output and "this machine's clock" in r.output, r.output
    assert objects(s3_env) == before


URL_READER = """
import sys, time
from pathlib import Path
from store import lease
from store.remote_cache import local_store
root = local_store(sys.argv[1], ["vae"], Path(sys.argv[2]))  # its lease object on the URL names vae v1
held = lease.hold(root, {"vae": None}, "a reader of the URL")  # as train's reader: a lease file in the cache
print(held.path, flush=True)
time.sleep(300)
"""


def test_a_url_reader_killed_with_9_holds_nothing_on_the_url_nor_in_its_cache(s3_env, store: Store,
                                                                                tmp_path: Path) -> None:
    """A real reader process of a URL (as train: a lease object on the URL, a lease file in its cache's store),
    killed with -9, leaves both behind. `store gc URL` and `store gc CACHE_STORE` on this host find its pid gone,
    remove its version and its leases, and say whose lease it was and why it is dead (the URL's gc named the
    object only)."""
    fill(store, 4, tag="a")  # v1
    push(store.root, s3_env.url())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", URL_READER, s3_env.url(), str(cache)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        cached_lease = Path(proc.stdout.readline().strip())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert cached_lease.is_file() and len([k for k in objects(s3_env) if "/.leases/" in k]) == 1
    fill(store, 4, tag="b", start=10)  # v2, current
    push(store.root, s3_env.url())

    r = _cli("store", "gc", s3_env.url())
    assert r.exit_code == 0, r.output
    (said,) = [line for line in r.output.splitlines() if line.startswith("remove the lease of a gone process: ")]
    assert f"(pid {proc.pid} on {socket.gethostname()} is gone" in said, r.output
    keys = objects(s3_env)
    assert not any("/.leases/" in k or k.startswith("store/vae/v1/") for k in keys), keys

    cache_store = cached_lease.parent.parent
    record = cached_lease.read_bytes()
    local_store(s3_env.url(), ["vae"], cache, lease=False)  # v2 into the cache: v1 is no longer current there
    assert not cached_lease.exists()  # the open removed the dead reader's lease file (store/remote_cache.py)
    cached_lease.write_bytes(record)  # as a reader killed after that open leaves it: gc says whose it was
    r = _cli("store", "gc", cache_store)
    assert r.exit_code == 0, r.output
    assert f"a reader of the URL (pid {proc.pid} on {socket.gethostname()} is gone" in r.output, r.output
    assert Store(cache_store).versions("vae") == [2] and not cached_lease.exists()


def _manifests(env) -> list[str]:
    return sorted(k for k in objects(env) if k.endswith("manifest.parquet"))


def test_gc_of_a_url_keeps_a_complete_version_whose_store_json_swap_failed(s3_env, store: Store,
                                                                           monkeypatch) -> None:
    """A commit that wrote its manifest and failed its store.json swap (a lost connection, a killed rank 0) leaves
    a complete version past the current one, which its rerun adopts (store/remote_parts.py `on_remote`). gc removed
    it at once, a cron gc in between throwing away a whole multi-node encode. Kept and said so; removed once a
    version past it is current."""
    from schemas.errors import UserError

    fill(store, 4, tag="a")  # v1
    push(store.root, s3_env.url())
    fill(store, 4, tag="b", start=10)  # v2

    def lost(self, *a, **k):
        raise ConnectionResetError("lost the connection")

    with monkeypatch.context() as m, pytest.raises(UserError):
        m.setattr(remote_mod.Remote, "swap", lost)
        push(store.root, s3_env.url())
    assert _manifests(s3_env) == ["store/vae/v1/manifest.parquet", "store/vae/v2/manifest.parquet"]

    r = _cli("store", "gc", s3_env.url())
    assert r.exit_code == 0 and "keep vae/v2: complete, never current (past the current v1)" in r.output, r.output
    assert _manifests(s3_env) == ["store/vae/v1/manifest.parquet", "store/vae/v2/manifest.parquet"]
    push(store.root, s3_env.url())  # the rerun: v2 current now
    assert _cli("store", "gc", s3_env.url()).exit_code == 0
    assert _manifests(s3_env) == ["store/vae/v2/manifest.parquet"]


def test_gc_of_a_url_removes_a_version_switched_away_from(s3_env, store: Store) -> None:
    """v2 current, then v1 made current again over it (a rerun of v1's settings adopting it: `make_current` over
    v2): v2 is past the current one, complete, and garbage. The remote's store.json records it (`was_current`,
    never copied from a pushing store's), so gc removes it, taking its number out of the record first."""
    from store import format as fmt
    from store.remote_parts import make_current
    from store.remote_sync import _parse_record

    fill(store, 4, tag="a")  # v1
    push(store.root, s3_env.url())
    fill(store, 4, tag="b", start=10)  # v2
    push(store.root, s3_env.url())
    remote = open_remote(s3_env.url())
    assert make_current(remote, "vae", 1, over=2) == 1

    def entry() -> dict:
        return _parse_record(remote.read(fmt.STORE_JSON), remote.url)["tables"]["vae"]

    assert entry() == {"current": 1, "was_current": [2]}
    r = _cli("store", "gc", s3_env.url())
    assert r.exit_code == 0 and "never current" not in r.output, r.output
    assert _manifests(s3_env) == ["store/vae/v1/manifest.parquet"] and entry() == {"current": 1}


def test_a_version_its_store_switched_away_from_is_not_pushed(store: Store, tmp_path: Path) -> None:
    """A local store switched back to v1 over v2 (`was_current`): v2 is garbage by its own record (its gc removes
    it), so push sends none of it and says so in a line; the URL holds v1 alone, current, which its gc keeps and a
    pull reads. Before, every complete version was sent, v2's tens of GB (1M samples) for the URL's gc to remove."""
    from store import format as fmt
    from store.gc import collect as local_gc
    from store.remote_gc import collect
    from store.remote_sync import _parse_record

    fill(store, 3)  # v1
    fill(store, 4, tag="b", start=10)  # v2, current
    store.set_current("vae", 1)  # a rerun of v1's settings adopted it
    url = (tmp_path / "remote").as_uri()
    summary = push(store.root, url)
    assert summary.copied == ["vae/v1"] and summary.garbage == ["vae/v2"], summary
    assert [line for line in str(summary).splitlines() if line.startswith("not sent vae/v2: ")], str(summary)
    assert not (tmp_path / "remote" / "vae" / "v2").exists()
    remote = open_remote(url)
    assert _parse_record(remote.read(fmt.STORE_JSON), url)["tables"]["vae"] == {"current": 1}
    lines: list[str] = []
    collect(url, grace_s=0, echo=lines.append)
    assert not any("remove" in line and "v1" in line for line in lines), lines
    assert sorted(p.parent.name for p in (tmp_path / "remote" / "vae").glob("v*/manifest.parquet")) == ["v1"]
    copy = tmp_path / "copy"
    pull(url, copy)
    want = {k: store.reader("vae").get(k)["tensors"] for k in store.reader("vae").keys()}
    reader = Store(copy, create=False).reader("vae")
    assert reader.version == 1 and sorted(reader.keys()) == sorted(want)
    for k, tensors in want.items():
        assert all(torch.equal(reader.get(k)["tensors"][n], t) for n, t in tensors.items())
    local_gc(store.root, echo=lambda line: None)
    assert store.versions("vae") == [1]


def test_a_switched_away_version_already_at_the_url_is_pushed_as_before(store: Store, tmp_path: Path) -> None:
    """v2 pushed while current (the URL's current), then the local store switched back to v1: v2 is there already,
    so push checks it as every present version (not skipped, no line) and keeps the URL's newer current v2."""
    from store import format as fmt
    from store.remote_sync import _parse_record

    fill(store, 3)  # v1
    url = (tmp_path / "remote").as_uri()
    push(store.root, url)  # while current (a superseded version is not pushed)
    fill(store, 4, tag="b", start=10)  # v2, current
    push(store.root, url)
    store.set_current("vae", 1)
    summary = push(store.root, url)
    assert summary.present == ["vae/v1", "vae/v2"] and not summary.garbage and summary.newer == ["vae/v2"], summary
    assert "not sent" not in str(summary)
    assert _parse_record(open_remote(url).read(fmt.STORE_JSON), url)["tables"]["vae"] == {"current": 2}


def test_a_pulled_version_the_url_switched_away_from_is_garbage_in_the_copy_too(store: Store, tmp_path: Path) -> None:
    """The URL switched back to v1 over v2 (`was_current` there); a copy that pulled v2 while it was current
    pulls again: its store.json records v2 as switched away from too, so its gc removes it as the URL's does.
    Before, the copy took it for a commit whose switch failed and kept it until a newer version was current. A
    fresh copy does not copy v2 at all (garbage at the URL: `test_pull_kept_only.py`)."""
    from store import format as fmt
    from store.gc import collect as local_gc
    from store.remote_parts import make_current

    fill(store, 3)  # v1
    url = (tmp_path / "remote").as_uri()
    push(store.root, url)  # while current (a superseded version is not pushed)
    fill(store, 4, tag="b", start=10)  # v2
    push(store.root, url)
    copy = tmp_path / "copy"
    pull(url, copy)  # v2 current: v1 is garbage at the URL, v2 copied
    assert make_current(open_remote(url), "vae", 1, over=2) == 1
    assert pull(url, copy).copied == ["vae/v1"]  # current again
    assert fmt.read_store_record(copy)["tables"]["vae"] == {"current": 1, "was_current": [2]}
    assert pull(url, tmp_path / "fresh").garbage == ["vae/v2"]
    lines: list[str] = []
    local_gc(copy, echo=lines.append)
    assert not any("never current" in line for line in lines), lines
    assert Store(copy).versions("vae") == [1]
