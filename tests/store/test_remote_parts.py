"""Ranks writing one version of a store URL through separate caches (store/remote_parts.py), in one process: each
rank uploads its own part write-once, rank 0 commits on the remote from the indexes alone; nothing is visible
before that, a rerun sends nothing twice, a part of another run is refused in one line."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest

from schemas import UserError
from store import Store
from store import remote as remote_mod
from store.remote_pull import pull
from store.verify import verify_store
from store_samples import key_of, rank_writer, vae_schema

N = 12


def _writer(cache: Path, url: str, rank: int, tag: str = "a"):
    return rank_writer(cache, url, rank, N, shard_size_mb=0.02, tag=tag)


def _finished(cache: Path, url: str, rank: int, tag: str = "a") -> None:
    """A rank's part written and marked done, its writer closed: its rank lock let go now (left to the garbage
    collector, a reference cycle could keep it held past the next writer of that rank: "being written by pid N")."""
    with _writer(cache, url, rank, tag) as w:
        w.finish_rank()


def _rank_1_uploaded_then_its_node_replaced(tmp_path: Path, url: str) -> None:
    """Rank 1's part is on the remote (its rank-done file too); then its node is replaced: its cache is gone."""
    _finished(tmp_path / "node1", url, 1)
    shutil.rmtree(tmp_path / "node1")


def _opened_on_the_new_node(tmp_path: Path, url: str):
    """Rank 1's writer opened on the replacing node's empty cache (it adopts what the remote holds of its part)."""
    return Store(tmp_path / "node1-new").writer("vae", vae_schema(), rank=1, world_size=2, shard_size_mb=0.02,
                                                version=1, remote_url=url)


def _committed_with_every_sample(tmp_path: Path, url: str) -> Path:
    """Rank 0 commits version 1 on the remote; a pull of it holds every sample. The pulled copy."""
    assert _writer(tmp_path / "node0", url, 0).commit() == 1
    pulled = tmp_path / "pulled"
    pull(url, pulled)
    assert Store(pulled).reader("vae").keys() == sorted(key_of(i) for i in range(N))
    return pulled


def _objects(s3_env, prefix: str) -> list[str]:
    found = s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix=prefix + "/").get("Contents", [])
    return [o["Key"][len(prefix) + 1:] for o in found]


def test_two_caches_commit_one_version_on_the_remote(s3_env, tmp_path, monkeypatch) -> None:
    url = s3_env.url("parts")
    zero = _writer(tmp_path / "node0", url, 0)
    with pytest.raises(UserError, match=r"ranks \[1\] have not uploaded their part"):
        zero.commit()  # rank 1 has not finished: refused, nothing visible
    names = _objects(s3_env, "parts")
    assert names and all(n.startswith("vae/v1/") for n in names) and "vae/v1/manifest.parquet" not in names
    assert not [n for n in names if n.startswith("vae/v1/shard-r01")]

    _finished(tmp_path / "node1", url, 1)
    sent = []
    real = remote_mod.Remote.upload
    monkeypatch.setattr(remote_mod.Remote, "upload",
                        lambda self, path, rel, *a: sent.append(rel) or real(self, path, rel, *a))
    again = _writer(tmp_path / "node0", url, 0)  # the rerun of rank 0 resumes its committed shards
    assert len(again.done_keys) == N // 2
    assert again.commit() == 1
    assert sent == ["vae/v1/checksums.json", "vae/v1/manifest.parquet"]  # its part was there already
    assert not (tmp_path / "node0" / "vae" / ".v1.commit").exists()

    pulled = tmp_path / "pulled"
    pull(url, pulled)
    r = Store(pulled).reader("vae")
    assert r.keys() == sorted(key_of(i) for i in range(N)) and r.manifest.num_rows == N  # each exactly once
    assert verify_store(pulled, progress=False) == []
    # inspect's counts recorded by rank 0's commit on the remote (pulled with checksums.json): the manifest's
    from store import version_counts
    from store.integrity import read_version_record
    from store.manifest_files import checked_manifest

    vdir = pulled / "vae" / "v1"
    assert version_counts.shown(read_version_record(vdir)["counts"]) == \
        version_counts.shown(version_counts.counted(checked_manifest(vdir))) and r.manifest.num_rows == N
    from store.remote_verify import verify_url

    assert verify_url(url, progress=False)[0] == []  # every object of the parts is listed in checksums.json


def test_a_node_that_lost_its_cache_keeps_what_it_uploaded(s3_env, tmp_path, monkeypatch) -> None:
    url = s3_env.url("lost")
    _rank_1_uploaded_then_its_node_replaced(tmp_path, url)
    sent = []
    real = remote_mod.Remote.upload
    monkeypatch.setattr(remote_mod.Remote, "upload",
                        lambda self, path, rel, *a: sent.append(rel) or real(self, path, rel, *a))
    fresh = _opened_on_the_new_node(tmp_path, url)
    assert fresh.done_keys == {key_of(i) for i in range(1, N, 2)}  # nothing to encode again
    assert not list(fresh.dir.glob("*.tar"))  # only the indexes came (the shards stay on the remote)
    fresh.given = N // 2
    fresh.finish_rank()
    assert sent == []  # its part was there already
    fresh.close()
    assert verify_store(_committed_with_every_sample(tmp_path, url), progress=False) == []


def test_a_part_of_another_run_is_refused_in_one_line(s3_env, tmp_path) -> None:
    url = s3_env.url("clash")
    _finished(tmp_path / "old", url, 1, tag="old")  # another run's rank 1 left its part of v1
    w = _writer(tmp_path / "new", url, 1, tag="new")
    with pytest.raises(UserError, match=r"exists with other content .*rerun") as e:
        w.finish_rank()
    assert "\n" not in str(e.value)
    w.close()


def test_a_complete_version_whose_swap_was_lost_is_found_for_its_own_schema_only(s3_env, tmp_path,
                                                                                 monkeypatch) -> None:
    """Rank 0's commit wrote the manifest and lost the store.json swap (a lost connection): v1 is complete, not
    current. `on_remote` offers it for adoption to a run of the same schema (its rerun), never to another."""
    from store.remote_parts import make_current, on_remote

    url = s3_env.url("lost-swap")
    _finished(tmp_path / "node1", url, 1)
    real = remote_mod.Remote.swap

    def lost(self, rel, *a, **k):
        if rel == "store.json":
            raise ConnectionError("connection reset by peer")
        return real(self, rel, *a, **k)

    monkeypatch.setattr(remote_mod.Remote, "swap", lost)
    with pytest.raises(UserError, match="lost the connection"):
        _writer(tmp_path / "node0", url, 0).commit()
    monkeypatch.setattr(remote_mod.Remote, "swap", real)
    names = _objects(s3_env, "lost-swap")
    assert "vae/v1/manifest.parquet" in names and "store.json" not in names
    found = on_remote(url, "vae", vae_schema("a").to_dict(), 2)
    assert (found.committed, found.rows, found.taken) == (1, N, {1})
    assert on_remote(url, "vae", vae_schema("b").to_dict(), 2).committed == 0  # another run's: taken, not adopted
    make_current(remote_mod.open_remote(url), "vae", 1)
    assert on_remote(url, "vae", vae_schema("a").to_dict(), 2).committed == 0  # current now: nothing to adopt
    assert pull(url, tmp_path / "pulled").copied == ["vae/v1"]  # current: what a reader opens


def test_a_gc_between_a_lost_swap_and_its_rerun_keeps_the_version_for_the_rerun(s3_env, tmp_path,
                                                                                  monkeypatch) -> None:
    """Two nodes' ranks commit v2 over the current v1, and rank 0 loses the store.json swap: v2 is complete on the
    remote and was never current. A `store gc` before the rerun removed it (the whole multi-node encode thrown
    away: the rerun encoded everything again); now gc keeps it, says so, and the rerun's look still offers it."""
    from store.remote_gc import collect
    from store.remote_parts import on_remote
    from store_samples import rank_writer

    url = s3_env.url("gc-swap")
    _finished(tmp_path / "node1", url, 1)
    assert _writer(tmp_path / "node0", url, 0).commit() == 1
    one = rank_writer(tmp_path / "node1", url, 1, N, 0.02, tag="b", version=2)
    one.finish_rank()
    one.close()  # the run is gone: no lease holds v2
    real = remote_mod.Remote.swap

    def lost(self, rel, *a, **k):
        if rel == "store.json":
            raise ConnectionError("connection reset by peer")
        return real(self, rel, *a, **k)

    zero = rank_writer(tmp_path / "node0", url, 0, N, 0.02, tag="b", version=2)
    with monkeypatch.context() as m, pytest.raises(UserError, match="lost the connection"):
        m.setattr(remote_mod.Remote, "swap", lost)
        zero.commit()
    zero.close()
    lines: list[str] = []
    collect(url, grace_s=0, echo=lines.append)
    assert "vae/v2/manifest.parquet" in _objects(s3_env, "gc-swap")
    assert any(line.startswith("keep vae/v2: complete, never current (past the current v1)") for line in lines), lines
    assert on_remote(url, "vae", vae_schema("b").to_dict(), 2).committed == 2


def test_the_version_number_skips_what_the_remote_holds_for_other_runs(s3_env, tmp_path) -> None:
    from store.remote_parts import on_remote

    url = s3_env.url("taken")
    _finished(tmp_path / "a", url, 1, tag="other")  # v1: parts of another run
    assert on_remote(url, "vae", vae_schema("a").to_dict(), 2).taken == {1}
    assert on_remote(url, "vae", vae_schema("other").to_dict(), 2).taken == set()  # its own parts: resumed
    assert on_remote(url, "vae", vae_schema("other").to_dict(), 3).taken == {1}  # written by 2 ranks, not 3


def test_one_cache_or_several_is_decided_by_the_kernel_and_the_folder_not_the_host_name(tmp_path,
                                                                                        monkeypatch) -> None:
    """Two nodes with one host name (`docker --hostname`, cloned VMs) and one cache path were taken for one cache:
    rank 0 then committed in its own cache and failed at the end ("ranks [...] have not finished"). A host is its
    kernel's boot id; and two folders under one path (containers of one kernel) are told apart by their inode."""
    import socket

    from schemas import host
    from stages.encode import nodes

    monkeypatch.setattr(socket, "gethostname", lambda: "node")  # every node's name
    cache = tmp_path / "cache"
    cache.mkdir()
    boot = tmp_path / "boot_id"
    monkeypatch.setattr(host, "BOOT_ID", str(boot))
    seen = {}
    for kernel in ("kernel-a", "kernel-b"):
        boot.write_text(kernel)
        seen[kernel] = nodes.cache_identity(cache)
    assert seen["kernel-a"] != seen["kernel-b"]
    assert nodes.cache_identity(cache) == seen["kernel-b"]  # the ranks of one node: one cache
    cache.rename(tmp_path / "elsewhere")
    cache.mkdir()  # another folder under the same path
    assert nodes.cache_identity(cache) != seen["kernel-b"]


def test_an_unreachable_remote_is_one_line(s3_env, tmp_path, monkeypatch) -> None:
    from s3_server import aws_env, unreachable_endpoint

    w = _writer(tmp_path / "node1", s3_env.url("gone"), 1)
    with unreachable_endpoint() as gone:
        aws_env(monkeypatch, gone)  # the server is gone before the upload
        with pytest.raises(UserError, match=r"upload of rank 1's part of table 'vae' v1: lost the connection") as e:
            w.finish_rank()
    assert "\n" not in str(e.value)
    w.close()


def test_every_nodes_quarantine_rows_reach_the_remote_merged(s3_env, tmp_path) -> None:
    """Each node rejects other samples into its own cache's quarantine.parquet; after the commit each node merges
    its rows into the remote's (compare-and-swap): the remote holds every node's rows once, a repeat adds none, and
    a pull merges them into a copy that already had some."""
    from store import quarantine
    from store.remote_parts import push_node_quarantine

    url = s3_env.url("rejects")
    rows = {0: [{"key": key_of(100), "source": "s", "stage": "encode-vae", "reason": "too_small"}],
            1: [{"key": key_of(101), "source": "s", "stage": "encode-vae", "reason": "damaged_input"},
                {"key": key_of(102), "source": "s", "stage": "encode-vae", "reason": "too_small"}]}
    writers = {}
    for rank in (0, 1):
        writers[rank] = _writer(tmp_path / f"node{rank}", url, rank)
        quarantine.add_rows(tmp_path / f"node{rank}", rows[rank])
    writers[1].finish_rank()
    writers[0].commit()
    for rank in (0, 1, 1):  # node 1 twice: a rerun adds nothing
        push_node_quarantine(writers[rank].store.root, url, "vae")

    pulled = tmp_path / "pulled"
    quarantine.add_rows(Store(pulled).root, rows[0])  # a copy that has node 0's row already
    pull(url, pulled)
    got = quarantine.read(pulled)
    assert sorted(zip(got.column("key").to_pylist(), got.column("reason").to_pylist())) == [
        (key_of(100), "too_small"), (key_of(101), "damaged_input"), (key_of(102), "too_small")]


def _encode_end(writer, monkeypatch):
    """stages/encode/commit.finish for rank 0 of a multi-node encode whose loop is done (its parts of the job
    that are not the store's stubbed): this node's rows, then the remote commit."""
    from types import SimpleNamespace

    from stages.encode import commit
    from stages.encode.summary import Summary

    for name in ("flush_quarantine", "check_damaged_total"):
        monkeypatch.setattr(commit, name, lambda job: None)
    monkeypatch.setattr(commit, "rank_shard_sizes", lambda job: {})
    summary = Summary(stage="encode-vae", table="vae")
    job = SimpleNamespace(summary=summary, writer=writer, store=writer.store,
                          ranks=SimpleNamespace(world_size=1, rank=0, local_rank=0),
                          started=0.0, loop_started=0.0, shard_sizes_before={}, repairing=None, lease=None,
                          images=SimpleNamespace(stop_check_ahead=lambda: None))
    return commit.finish(job)


def test_a_damaged_remote_quarantine_stops_a_multi_node_encode_before_its_commit(s3_env, tmp_path, monkeypatch):
    """The node's rejected rows are merged into the remote's quarantine.parquet after the commit; a damaged one
    is found before it (one line), so no version is committed without its rows, and after `store repair` sets the
    file aside a rerun commits the version and its rows."""
    from store import quarantine
    from store.remote_push import check_quarantine

    url = s3_env.url("qdamaged")
    _finished(tmp_path / "node1", url, 1)
    zero = _writer(tmp_path / "node0", url, 0)
    quarantine.add_rows(tmp_path / "node0", [{"key": key_of(100), "source": "s", "stage": "encode-vae",
                                               "reason": "too_small"}])
    s3_env.client().put_object(Bucket=s3_env.bucket, Key="qdamaged/quarantine.parquet", Body=b"not parquet")
    with pytest.raises(UserError, match=r"qdamaged/quarantine.parquet is damaged .*pipeline store repair") as e:
        _encode_end(zero, monkeypatch)
    assert "\n" not in str(e.value)
    zero.close()  # as the encoder's error path (stages/encode/commit.close)
    names = _objects(s3_env, "qdamaged")
    assert "vae/v1/manifest.parquet" not in names and "store.json" not in names  # nothing committed

    s3_env.client().delete_object(Bucket=s3_env.bucket, Key="qdamaged/quarantine.parquet")  # as repair sets it aside
    check_quarantine(remote_mod.open_remote(url), tmp_path / "node0")
    summary = _encode_end(_writer(tmp_path / "node0", url, 0), monkeypatch)  # the rerun resumes and commits
    assert summary.version == 1 and summary.committed_to == url
    assert summary.committed_line() == f"committed table 'vae' v1 at {url}"  # current: nothing more to say
    pulled = tmp_path / "pulled"
    pull(url, pulled)
    assert Store(pulled).reader("vae").manifest.num_rows == N
    assert quarantine.read(pulled).column("key").to_pylist() == [key_of(100)]


def test_a_rank_shard_damaged_before_its_upload_is_refused_with_nothing_visible(s3_env, tmp_path) -> None:
    """The bytes a rank uploads are checked against what it recorded as they are read (store/remote_upload.py):
    a shard damaged on its node's disk after its rank committed it is refused, named, and never appears."""
    url = s3_env.url("rot")
    w = _writer(tmp_path / "node1", url, 1)
    shard = sorted(w.dir.glob("shard-r01-*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match="is damaged") as e:
        w.finish_rank()
    assert str(shard) in str(e.value) and "not sent" in str(e.value) and "\n" not in str(e.value)
    assert f"vae/v1/{shard.name}" not in _objects(s3_env, "rot")
    assert "vae/v1/rank-01.done" not in _objects(s3_env, "rot")
    w.close()


def _rank_of(cache: Path, url: str, rank: int, world: int, n: int):
    """Rank `rank` of `world` writing its share of `n` samples into v1 (as `rank_writer`, for any world size)."""
    from store_samples import sample

    w = Store(cache).writer("vae", vae_schema(), rank=rank, world_size=world, shard_size_mb=0.005, version=1,
                            remote_url=url)
    w.given = len(range(rank, n, world))
    for i in range(rank, n, world):
        s = sample(i)
        if s["key"] not in w.done_keys:
            w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    return w


@pytest.mark.parametrize("scheme", ["s3", "file"])
def test_a_rank_lists_only_its_own_objects_of_the_version(scheme, tmp_path, monkeypatch, request) -> None:
    """Each rank's open (adopting what it uploaded) and upload listed the whole `<table>/v<N>/` (~40k objects at 1M
    samples, by each of 64 ranks, twice). Now only its own shards' prefix - `shard-r01-`, never rank 10's
    `shard-r10-` - plus one lookup per other file it sends; a rerun still finds everything there and sends
    nothing, and a node that lost its cache still adopts its uploaded part. On S3 the server lists the prefix."""

    from store import remote_parts

    url = request.getfixturevalue("s3_env").url("own") if scheme == "s3" else f"file://{tmp_path / 'remote'}"
    world, n = 11, 44
    _rank_of(tmp_path / "node10", url, 10, world, n).finish_rank()  # rank 10's part: on the remote first
    listed, served = [], []
    real_listing, real_open = remote_mod.Remote.listing, remote_parts.open_remote

    def listing(self, *a, **k):
        got = real_listing(self, *a, **k)
        listed.extend(got)
        return got

    def open_remote(*a, **k):  # what the back end itself returned (S3: the server's listing)
        remote = real_open(*a, **k)
        find = remote.fs.find

        @functools.wraps(find)
        def counted(*fa, **fk):
            got = find(*fa, **fk)
            served.extend(got)
            return got

        remote.fs.find = counted
        return remote

    monkeypatch.setattr(remote_mod.Remote, "listing", listing)
    monkeypatch.setattr(remote_parts, "open_remote", open_remote)
    sent = []
    real_upload = remote_mod.Remote.upload
    monkeypatch.setattr(remote_mod.Remote, "upload",
                        lambda self, path, rel, *a: sent.append(rel) or real_upload(self, path, rel, *a))

    one = _rank_of(tmp_path / "node1", url, 1, world, n)
    one.finish_rank()
    one.close()
    mine = {rel for rel in sent if rel.startswith("vae/v1/shard-r01-")}
    # schema.json and world-size.json: rank 10 sent the same, each found by its own lookup
    assert len(mine) > 2 and set(sent) == mine | {"vae/v1/rank-01.done"}
    shutil.rmtree(tmp_path / "node1")  # its node replaced: the rerun adopts its part, sends nothing
    sent.clear()
    again = _rank_of(tmp_path / "node1-new", url, 1, world, n)
    assert again.done_keys == {key_of(i) for i in range(1, n, world)}
    again.finish_rank()
    again.close()
    assert sent == []
    # rank 10's shards, its rank-done file, schema.json: never listed. The first run's listings found nothing of
    # rank 1 yet; the rerun's open and its upload each listed its shards and indexes, nothing else
    assert sorted(listed) == sorted([*mine, *mine]), sorted(listed)
    if scheme == "s3":
        assert served and all("/vae/v1/shard-r01-" in name for name in served), sorted(served)


def test_a_commit_overtaken_by_another_writers_newer_version_says_which_stays_current(s3_env, tmp_path,
                                                                                    monkeypatch) -> None:
    """Another writer commits v2 while rank 0 commits v1: store.json's compare-and-swap keeps v2 current (the
    remote is never rolled back), and the encode said "committed v1" as if v1 were current. Now the commit, and
    a rerun's adoption of a complete version whose swap was lost, say in one line that v2 stays current, and
    `--json` records it (`newer_current`)."""
    from types import SimpleNamespace

    from stages.encode.output import _adopt_committed
    from stages.encode.summary import Summary
    from store.checksum import unseal
    from store.remote_parts import make_current

    url = s3_env.url("overtaken")
    _finished(tmp_path / "node1", url, 1)
    real = remote_mod.Remote.swap
    raced = []

    def swap(self, rel, update, *a, **k):  # v2 of another writer becomes current right before our swap
        if rel == "store.json" and not raced:
            raced.append(rel)
            make_current(self, "vae", 2)
        return real(self, rel, update, *a, **k)

    monkeypatch.setattr(remote_mod.Remote, "swap", swap)
    summary = _encode_end(_writer(tmp_path / "node0", url, 0), monkeypatch)
    assert raced and (summary.version, summary.newer_current) == (1, 2)
    assert summary.committed_line() == (f"committed table 'vae' v1 at {url}; v2, committed by another writer "
                                        "meanwhile, stays current (v1 is complete, not current)")
    assert summary.to_json()["newer_current"] == 2
    record = unseal(s3_env.client().get_object(Bucket=s3_env.bucket, Key="overtaken/store.json")["Body"].read())
    assert record["tables"]["vae"]["current"] == 2 and "vae/v1/manifest.parquet" in _objects(s3_env, "overtaken")

    # a rerun that adopts v1 (complete, its swap lost as far as it knows) tells the same
    job = SimpleNamespace(summary=Summary(stage="encode-vae", table="vae"), store=Store(tmp_path / "node0"),
                          ranks=SimpleNamespace(world_size=1, rank=0, local_rank=0))
    _adopt_committed(job, url, 1, N, vae_schema())
    assert (job.summary.version, job.summary.up_to_date, job.summary.newer_current) == (1, True, 2)
    assert job.summary.committed_line().endswith("; v2, committed by another writer meanwhile, stays current "
                                                 "(v1 is complete, not current)")
    assert make_current(remote_mod.open_remote(url), "vae", 3) == 3  # a higher one moves it on


def test_a_rerun_adopts_its_complete_version_over_the_current_one_it_saw_never_over_a_newer_one(
        s3_env, tmp_path, monkeypatch) -> None:
    """Our v1 is complete on the remote; another writer's v2 (another schema) is current. `on_remote` offered only
    versions above the current one, so the rerun of our settings encoded everything again into v3 (hours at 1M
    samples). Now it offers v1 with the current one it saw, and `make_current` over that one makes v1 current, as a
    local store's rerun does (`find_version` + `set_current`); a version made current meanwhile still stays."""
    from store.remote_parts import make_current, on_remote
    from store_samples import sample

    url = s3_env.url("rerun")
    for version, tag in ((1, "a"), (2, "b")):  # two nodes' caches each, committed in turn
        writers = []
        for rank in (1, 0):
            w = Store(tmp_path / f"v{version}-node{rank}").writer(
                "vae", vae_schema(tag), rank=rank, world_size=2, shard_size_mb=0.02, version=version, remote_url=url)
            w.given = len(range(rank, N, 2))
            for i in range(rank, N, 2):
                s = sample(i)
                w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
            writers.append(w)
        writers[0].finish_rank()
        writers[0].close()
        assert writers[1].commit() == version
    remote = remote_mod.open_remote(url)
    found = on_remote(url, "vae", vae_schema("a").to_dict(), 2)
    assert (found.committed, found.rows, found.current) == (1, N, 2)
    assert on_remote(url, "vae", vae_schema("b").to_dict(), 2).committed == 0  # its version is current
    assert make_current(remote, "vae", 1) == 2  # not chosen over v2: never rolled back
    assert make_current(remote, "vae", 1, over=2) == 1
    assert on_remote(url, "vae", vae_schema("b").to_dict(), 2)[1:] == (2, N, 1)  # their rerun takes v2 back
    real = remote_mod.Remote.swap

    def swap(self, rel, update, *a, **k):  # a third writer makes v3 current right before the swap
        if rel == "store.json":
            monkeypatch.setattr(remote_mod.Remote, "swap", real)
            make_current(self, "vae", 3)
        return real(self, rel, update, *a, **k)

    monkeypatch.setattr(remote_mod.Remote, "swap", swap)
    assert make_current(remote, "vae", 2, over=1) == 3  # v1, which it chose to replace, is no longer current



def test_an_index_damaged_on_the_remote_is_refused_at_the_commit_with_nothing_committed(tmp_path) -> None:
    """An index object changed on the remote after its rank uploaded it (a flipped bit, same size): rank 0's commit
    checks the bytes it fetched against the rank's record (no longer a second read of its staged copy) and refuses
    before parsing them, in one line naming the object; nothing is committed."""
    url = f"file://{tmp_path / 'remote'}"
    _finished(tmp_path / "node1", url, 1)
    obj = sorted((tmp_path / "remote" / "vae" / "v1").glob("shard-r01-*.index.parquet"))[0]
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x01
    obj.chmod(0o644)
    obj.write_bytes(bytes(data))
    zero = _writer(tmp_path / "node0", url, 0)
    with pytest.raises(UserError, match=rf"vae/v1/{obj.name} does not match its rank's record; rerun every node"):
        zero.commit()
    assert not (tmp_path / "remote" / "vae" / "v1" / "manifest.parquet").exists()
    assert not (tmp_path / "remote" / "vae" / "v1" / "checksums.json").exists()


def test_a_version_that_would_be_empty_leaves_nothing_on_the_remote(s3_env, tmp_path) -> None:
    """Every rank rejected every key it was given: rank 0's commit refuses an empty version, as on one disk, and
    like a local store (its folder removed: `discard_version`) it leaves nothing behind: the ranks' uploaded parts
    (schema.json, world-size.json, rank-done files) are deleted from the remote, rank 0's cached folder too.
    They stayed under `vae/v1/` until a `store gc` at the URL."""
    url = s3_env.url("empty")
    writers = {r: Store(tmp_path / f"node{r}").writer("vae", vae_schema(), rank=r, world_size=2, version=1,
                                                      remote_url=url) for r in (0, 1)}
    for w in writers.values():
        w.given = 3  # every key rejected
    writers[1].finish_rank(rejected=3)
    writers[1].close()
    assert [n for n in _objects(s3_env, "empty") if n.startswith("vae/v1/")]  # rank 1's part is up there
    with pytest.raises(UserError, match=r"table 'vae' v1 would be empty") as e:
        writers[0].commit(allow_empty=False)
    assert "\n" not in str(e.value)
    assert [n for n in _objects(s3_env, "empty") if not n.startswith(".leases/")] == []
    assert _objects(s3_env, "empty/.leases") == []  # every push lease released
    assert not (tmp_path / "node0" / "vae" / "v1").exists()
    assert not list((tmp_path / "node0" / "vae").glob(".v1*"))

def test_a_node_whose_adopted_part_was_collected_since_encodes_it_again(s3_env, tmp_path) -> None:
    """A replaced node's rank adopts the indexes of its part on the remote (the shards stay there); that run is
    killed too (spot instances), and a `store gc` meanwhile removes the incomplete version, which no live run holds.
    Before, every rerun skipped those keys (their adopted indexes were in the cache) and refused the upload of
    shards neither the cache nor the remote had ("... remove the incomplete version on the remote (`pipeline store
    gc`) and rerun": the advice already followed, for ever). Now the open drops such indexes: their keys are
    encoded again, and the version commits whole."""
    from store.remote_gc import collect

    url = s3_env.url("regc")
    _rank_1_uploaded_then_its_node_replaced(tmp_path, url)
    adopted = _opened_on_the_new_node(tmp_path, url)
    assert adopted.done_keys and not list(adopted.dir.glob("*.tar"))  # the indexes alone came
    adopted.close()  # killed before its upload
    collect(url, grace_s=0, echo=lambda line: None)  # no live run: the incomplete version goes
    assert not _objects(s3_env, "regc")

    again = _writer(tmp_path / "node1-new", url, 1)
    assert len(again.done_keys) == 0  # what the remote lost is encoded again
    again.finish_rank()
    again.close()
    assert verify_store(_committed_with_every_sample(tmp_path, url), progress=False) == []


def test_a_damaged_index_a_node_adopted_is_fetched_again_not_a_traceback(s3_env, tmp_path, caplog) -> None:
    """An index a replaced node adopted from the remote (its shard stays there) is damaged in the cache (a disk
    error, a copy killed mid-write). The next open read it unguarded (`_drop_orphan_indexes`): pyarrow's traceback
    on every rerun. Now it is dropped with one line and fetched again from the remote, and its keys count as done."""
    url = s3_env.url("dmgidx")
    _rank_1_uploaded_then_its_node_replaced(tmp_path, url)
    adopted = _opened_on_the_new_node(tmp_path, url)
    done = set(adopted.done_keys)
    adopted.close()
    index = sorted((tmp_path / "node1-new" / "vae" / "v1").glob("*.index.parquet"))[0]
    index.write_bytes(index.read_bytes()[:20])  # truncated
    again = _writer(tmp_path / "node1-new", url, 1)
    assert set(again.done_keys) == done and not list(again.dir.glob("*.tar"))
    said = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert len(said) == 1 and str(index) in said[0] and "\n" not in said[0], said
    again.finish_rank()
    again.close()
    _committed_with_every_sample(tmp_path, url)


@pytest.mark.parametrize("damage", ["truncated", "not a count"])
def test_a_damaged_rank_done_file_on_the_remote_is_refused_in_one_line_and_its_advice_works(s3_env, tmp_path,
                                                                                            damage):
    """rank 0's commit parses every other rank's rank-done file from the remote: a truncated one (a bad disk, a
    copy by hand) was a JSONDecodeError traceback. Refused naming the object, nothing committed; deleting it and
    rerunning that rank (its cache rewrites and uploads it) commits."""
    url = s3_env.url("done")
    one = _writer(tmp_path / "node1", url, 1)
    one.finish_rank()
    one.close()  # its lock: the rerun below opens the same cache
    key = "done/vae/v1/rank-01.done"
    whole = s3_env.client().get_object(Bucket=s3_env.bucket, Key=key)["Body"].read()
    import json

    bad = whole[: len(whole) // 2] if damage == "truncated" else json.dumps({**json.loads(whole), "given": "6"}).encode()
    s3_env.client().put_object(Bucket=s3_env.bucket, Key=key, Body=bad)
    zero = _writer(tmp_path / "node0", url, 0)
    with pytest.raises(UserError, match="is damaged") as e:
        zero.commit()
    assert f"{url}/vae/v1/rank-01.done" in str(e.value) and "delete it" in str(e.value) and "\n" not in str(e.value)
    assert "vae/v1/manifest.parquet" not in _objects(s3_env, "done")
    zero.close()

    s3_env.client().delete_object(Bucket=s3_env.bucket, Key=key)  # the advice
    _finished(tmp_path / "node1", url, 1)
    _committed_with_every_sample(tmp_path, url)
