"""One version of a store URL written through several caches (store/remote_parts.py) across runs: a run killed and
rerun with another number of ranks (a node more or less), a rank whose part falls short of its keys, and a
`store gc` during the commit. The ranks are threads of this process, agreeing on the version through
stages/encode/nodes.writer_place over an in-process stand-in for models/collective's all-reduce."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from schemas import UserError
from store import Store
from store import remote_parts
from store.partition import rank_slice
from store.remote_pull import pull
from store_samples import key_of, sample, vae_schema


@pytest.fixture
def ranks_as_threads(monkeypatch):
    """models.collective for ranks that are threads: `together` a plain block, the all-reduce over a barrier."""
    import models.collective as collective

    state = SimpleNamespace(barrier=None, box={}, local=threading.local())

    def reduce(world, values, op):
        state.box[state.local.rank] = list(values)
        state.barrier.wait()
        out = [max(c) if op == "MAX" else sum(c) for c in zip(*(state.box[r] for r in range(world)))]
        state.barrier.wait()  # every rank has read the box before the next reduce fills it
        return out

    @contextmanager
    def together(world, what=""):
        yield

    monkeypatch.setattr(collective.agree, "_all_reduce", reduce)  # all_max's, all_sum's
    monkeypatch.setattr(collective, "together", together)

    def place(url: str, caches: list[Path]) -> list[int]:
        """stages/encode/nodes.writer_place on every rank (rank r writes through caches[r]): the versions agreed."""
        from stages.encode.nodes import writer_place

        world = len(caches)
        state.barrier, state.box = threading.Barrier(world), {}
        agreed: dict[int, object] = {}

        for cache in caches:  # a cache of the URL (store/remote_cache.py)
            cache.mkdir(parents=True, exist_ok=True)
            (cache / remote_parts.SOURCE_URL).write_text(url)

        def rank(r: int) -> None:
            state.local.rank = r
            job = SimpleNamespace(ranks=SimpleNamespace(rank=r, world_size=world),
                                  summary=SimpleNamespace(table="vae", stage="encode-vae"), store=Store(caches[r]),
                                  serving=())
            try:
                agreed[r] = writer_place(job, vae_schema())
            except BaseException as e:  # noqa: BLE001  raised in the test's thread below
                agreed[r] = e
                state.barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in range(world):
            if isinstance(agreed[r], BaseException):
                raise agreed[r]
        assert all(agreed[r][1] == url for r in range(world))
        return [agreed[r][0] for r in range(world)]

    return place


def _rank(cache: Path, url: str, rank: int, world: int, version: int, n: int):
    """Rank `rank` of `world` writing its share of `n` samples (keys its cache has committed skipped: a rerun)."""
    w = Store(cache).writer("vae", vae_schema(), rank=rank, world_size=world, shard_size_mb=0.002, version=version,
                            remote_url=url)
    a, b = rank_slice(n, rank, world)
    w.given = b - a
    for i in range(a, b):
        s = sample(i)
        if s["key"] not in w.done_keys:
            w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    return w


def _killed_run(url: str, caches: list[Path], place, n: int, finished: tuple[int, ...] = ()) -> int:
    """A run whose ranks committed every shard in their caches and were killed before the commit; the ranks in
    `finished` had uploaded their part."""
    versions = place(url, caches)
    for r, cache in enumerate(caches):
        w = _rank(cache, url, r, len(caches), versions[r], n)
        if r in finished:
            w.finish_rank()
            w.close()
        else:
            _kill(w)
    return versions[0]


def _kill(w) -> None:
    w._shards.commit()  # its last shard committed, then the process killed
    w.close()


def _run(url: str, caches: list[Path], place, n: int) -> int:
    versions = place(url, caches)
    assert len(set(versions)) == 1
    for r in range(1, len(caches)):
        w = _rank(caches[r], url, r, len(caches), versions[r], n)
        w.finish_rank()
        w.close()
    return _rank(caches[0], url, 0, len(caches), versions[0], n).commit(allow_empty=False)


def _committed(url: str, tmp_path: Path) -> list[str]:
    from store.remote_verify import verify_url

    assert verify_url(url, progress=False)[0] == []
    pulled = tmp_path / "pulled"
    pull(url, pulled)
    return Store(pulled).reader("vae").keys()


def test_a_rerun_with_fewer_ranks_per_node_encodes_a_new_version_with_every_sample(
        s3_env, tmp_path, ranks_as_threads) -> None:
    """2 nodes x 2 ranks killed, rerun on 2 nodes x 1: each node's cache holds shards of ranks 0 and 1 of 4, whose
    shares differ from those of 2 ranks; counting them done committed 4 of 16 samples."""
    url, n = s3_env.url("fewer"), 16
    a, b = tmp_path / "nodeA", tmp_path / "nodeB"
    assert _killed_run(url, [a, a, b, b], ranks_as_threads, n) == 1

    v = ranks_as_threads(url, [a, b])[0]
    w1 = _rank(b, url, 1, 2, v, n)
    w1.finish_rank()
    w1.close()
    _kill(_rank(a, url, 0, 2, v, n))  # killed again before its commit: the same 2 ranks resume their version
    assert ranks_as_threads(url, [a, b]) == [v, v]
    w0 = _rank(a, url, 0, 2, v, n)
    assert len(w0.done_keys) == n // 2  # its committed shards are kept
    w0.commit(allow_empty=False)
    assert _committed(url, tmp_path) == sorted(key_of(i) for i in range(n))
    assert v == 2  # parts of 4 ranks are another run
    with pytest.raises(UserError, match=r"v1 holds parts written by 4 ranks, not these 2") as e:
        _rank(a, url, 0, 2, 1, n)  # the old version forced on 2 ranks: refused, not resumed
    assert "\n" not in str(e.value)


def test_a_rerun_without_a_dead_node_encodes_a_new_version_with_every_sample(
        s3_env, tmp_path, ranks_as_threads) -> None:
    """3 nodes x 2 ranks killed (node C's ranks had uploaded their part), rerun on 2 nodes x 2: the parts written
    by 6 ranks are another run (it failed on "duplicate keys across shards" at every rerun: parts are
    write-once)."""
    url, n = s3_env.url("dropped"), 24
    a, b, c = tmp_path / "nodeA", tmp_path / "nodeB", tmp_path / "nodeC"
    assert _killed_run(url, [a, a, b, b, c, c], ranks_as_threads, n, finished=(4, 5)) == 1
    assert _run(url, [a, a, b, b], ranks_as_threads, n) == 2
    assert _committed(url, tmp_path) == sorted(key_of(i) for i in range(n))
    want = vae_schema().to_dict()
    assert remote_parts.on_remote(url, "vae", want, 4).taken == {1, 2}  # v1: parts of 6 ranks; v2: complete
    assert remote_parts.on_remote(url, "vae", want, 6).taken == {2}


def test_a_part_short_of_its_keys_is_never_committed(s3_env, tmp_path) -> None:
    """The last check before the manifest: the rows plus the rejected samples must be the keys the ranks were
    given. A rank that lost a sample without rejecting it stops the commit in one line, nothing visible; one that
    rejected it (quarantined) commits."""
    url, n = s3_env.url("short"), 12
    w1 = _rank(tmp_path / "node1", url, 1, 2, 1, n)
    w1.given += 1  # a key it was given, neither written nor rejected
    w1.finish_rank()
    w1.close()
    w0 = _rank(tmp_path / "node0", url, 0, 2, 1, n)
    with pytest.raises(UserError, match=r"12 rows plus 0 rejected samples, but the ranks were given 13 keys: "
                                        r"samples missing; nothing committed") as e:
        w0.commit(allow_empty=False)
    assert "\n" not in str(e.value)
    names = [o["Key"] for o in s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix="short/")["Contents"]]
    assert "short/vae/v1/manifest.parquet" not in names and "short/store.json" not in names

    url = s3_env.url("rejected")
    w1 = _rank(tmp_path / "node1b", url, 1, 2, 1, n)
    w1.given += 1
    w1.finish_rank(rejected=1)  # the sample it quarantined
    w1.close()
    assert _rank(tmp_path / "node0b", url, 0, 2, 1, n).commit(allow_empty=False) == 1


def _gc_before_the_manifest(monkeypatch, before) -> None:
    real = remote_parts._manifest

    def manifest(*a, **k):
        before()
        return real(*a, **k)

    monkeypatch.setattr(remote_parts, "_manifest", manifest)


def test_store_gc_during_the_commit_keeps_the_parts(s3_env, tmp_path, monkeypatch) -> None:
    """The parts have no manifest until the commit: a `store gc URL` then (incomplete versions past the grace
    period that no live lease names are removed) deleted them, and the commit made a version current whose data
    was gone. The ranks hold a push lease on the version from their writer's open to the commit."""
    from store.remote_gc import collect

    url, n = s3_env.url("gcparts"), 12
    w1 = _rank(tmp_path / "node1", url, 1, 2, 1, n)
    w1.finish_rank()
    w1.close()
    said: list[str] = []
    _gc_before_the_manifest(monkeypatch, lambda: collect(url, grace_s=0, echo=said.append))
    assert _rank(tmp_path / "node0", url, 0, 2, 1, n).commit(allow_empty=False) == 1
    assert any(line.startswith("keep vae/v1") for line in said), said
    assert _committed(url, tmp_path) == sorted(key_of(i) for i in range(n))
    leases = s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix="gcparts/.leases/").get("Contents", [])
    assert leases == []  # released with the writers


def test_a_part_gone_before_the_manifest_stops_the_commit(s3_env, tmp_path, monkeypatch) -> None:
    """A gc that checked the leases just before a rank wrote its own deletes a moment later: rank 0 lists the
    version again right before the manifest and refuses, in one line, to commit a version with a part gone."""
    url, n = s3_env.url("gone"), 12
    w1 = _rank(tmp_path / "node1", url, 1, 2, 1, n)
    w1.finish_rank()
    w1.close()
    shard = "gone/vae/v1/shard-r01-000000.tar"
    _gc_before_the_manifest(monkeypatch, lambda: s3_env.client().delete_object(Bucket=s3_env.bucket, Key=shard))
    with pytest.raises(UserError, match=r"shard-r01-000000.tar disappeared from the remote before the commit") as e:
        _rank(tmp_path / "node0", url, 0, 2, 1, n).commit(allow_empty=False)
    assert "\n" not in str(e.value)
    names = [o["Key"] for o in s3_env.client().list_objects_v2(Bucket=s3_env.bucket, Prefix="gone/")["Contents"]]
    assert "gone/vae/v1/manifest.parquet" not in names and "gone/store.json" not in names
