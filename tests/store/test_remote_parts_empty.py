"""A multi-node encode whose every input was rejected (stages/encode/commit.finish): rank 0's commit refuses the empty
version, removing the remote's parts and its own node's cached folder, and every other node removes its cached
folder of that version too, all ranks stopping with rank 0's one line. Before, the other nodes kept theirs (its
rank-done file, schema.json) of a version no longer anywhere. The ranks are threads of this process, each writing
through its own node's cache of a store URL, over an in-process stand-in for models/collective's decisions."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from store_samples import rank_writer


@pytest.fixture
def two_ranks_as_threads(monkeypatch) -> threading.local:
    """models.collective for 2 ranks that are threads (each sets `.rank` on the returned local): the all-reduce and
    `together`'s agreement over a barrier (an error on any rank: the lowest failing rank's line, as `RankFailed`,
    on every rank)."""
    import models.collective as collective

    barrier, box, local = threading.Barrier(2, timeout=60), {}, threading.local()

    def exchange(value) -> list:
        box[local.rank] = value
        barrier.wait()
        out = [box[r] for r in range(2)]
        barrier.wait()  # every rank has read the box before the next exchange fills it
        return out

    def reduce(world, values, op):
        return [max(c) if op == "MAX" else sum(c) for c in zip(*exchange(list(values)))]

    @contextmanager
    def together(world, what="", uneven=False):
        error = None
        try:
            yield
        except Exception as e:  # noqa: BLE001 - agreed below
            error = e
        failed = [m for m in exchange(None if error is None else str(error)) if m is not None]
        if failed:
            raise collective.RankFailed(failed[0])

    monkeypatch.setattr(collective.agree, "_all_reduce", reduce)  # all_max's, all_sum's
    monkeypatch.setattr(collective, "together", together)
    return local


def _job(rank: int, writer):
    """An encode job of rank `rank` of 2 whose loop is done and rejected every key it was given."""
    from stages.encode.summary import Summary

    writer.given = 2
    return SimpleNamespace(summary=Summary(stage="encode-vae", table="vae", quarantined=2), writer=writer,
                           store=writer.store, ranks=SimpleNamespace(world_size=2, rank=rank, local_rank=0),
                           started=0.0, loop_started=0.0, shard_sizes_before={}, repairing=None, lease=None,
                           images=SimpleNamespace(stop_check_ahead=lambda: None))


def test_every_node_removes_its_cached_folder_of_an_empty_version(two_ranks_as_threads, monkeypatch, tmp_path):
    from stages.encode import commit

    for name in ("flush_quarantine", "check_damaged_total"):  # the parts of the job that are not the store's
        monkeypatch.setattr(commit, name, lambda job: None)
    monkeypatch.setattr(commit, "rank_shard_sizes", lambda job: {})
    monkeypatch.setattr(commit, "push_node_rows", lambda job, url=None: None)
    url = f"file://{tmp_path / 'remote'}"
    jobs = {r: _job(r, rank_writer(tmp_path / f"node{r}", url, r, 0, shard_size_mb=0.02)) for r in (0, 1)}
    ended: dict[int, BaseException | None] = {}

    def rank(r: int) -> None:
        two_ranks_as_threads.rank = r
        try:
            commit.finish(jobs[r])
            ended[r] = None
        except BaseException as e:  # noqa: BLE001 - looked at below
            ended[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    line = ("table 'vae' v1 would be empty: every input was rejected (reasons in each node's cached "
            "quarantine.parquet); fix the inputs or the settings")
    assert [str(ended[r]) for r in (0, 1)] == [line, line]
    assert not [p for p in (tmp_path / "remote").rglob("*") if p.is_file() and "/vae/" in str(p)]
    for r in (0, 1):
        assert not (tmp_path / f"node{r}" / "vae" / "v1").exists(), f"node {r} kept its folder of the empty version"
