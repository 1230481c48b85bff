"""A rank that looks for a peer's line (`peer_failure`: the CLI's SIGTERM handler, a collective's error) or publishes
its own (`publish_failure`) once the launch's store is gone - its process ended, its port refuses (`store_host_gone`)
- does not connect: `_store_client` takes a refused port for a store still starting and tries it for its whole
timeout. Before, 10 s each (a real launch, 2 nodes x 2 workers: node 1's rank 3, frozen until node 0's agent had
ended, SIGTERMed by its own agent, sat in that retry loop 10 s before its exit)."""

from __future__ import annotations

from own_collective import own_collective, patch_where_used  # noqa: F401  (the fixture)


def test_a_rank_whose_store_is_gone_neither_reads_nor_publishes_through_it(monkeypatch, own_collective):  # noqa: F811
    collective = own_collective
    connects = []
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    patch_where_used(monkeypatch, "store_host_gone", lambda: True)
    patch_where_used(monkeypatch, "_store_client", lambda *args, **kwargs: connects.append(args))
    collective.state.run.update(watching=True, world=2)
    assert collective.peer_failure() is None
    assert collective.publish_failure("rank 1: its disk is full", 2) == "rank 1: its disk is full"
    assert connects == []
