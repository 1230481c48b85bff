"""A killed multi-rank write resumed by writers given their rank's share (`TableWriter(share=...)`, as encode
opens them): each rank learns which keys of its own share are committed. With the same world size (the usual
resume) each rank reads its own shards' indexes only - not all 64 ranks' in every rank, at 1M samples - and with
another world size (the shares moved) every rank still finds every committed key of its new share: the resumed
table holds each key exactly once."""

from __future__ import annotations

import threading
from unittest import mock

import pytest

from store import Store
from store import writer_open
from store.partition import rank_slice
from store_samples import key_of, sample, vae_schema

N = 60
INDEX = {key_of(i): i for i in range(N)}


def shares(world: int) -> list[list[str]]:
    """Each rank's keys, contiguous slices as encode's `iter_keys` gives them."""
    keys = [key_of(i) for i in range(N)]
    return [keys[slice(*rank_slice(N, r, world))] for r in range(world)]


def write_part(store: Store, world: int, upto: float) -> set[str]:
    """Each rank of `world` writes the first `upto` of its share in tiny shards, then stops (killed: no commit)."""
    written = set()
    for rank, share in enumerate(shares(world)):
        w = store.writer("vae", vae_schema(), rank=rank, world_size=world, shard_size_mb=0.002, version=1)
        for k in share[: int(len(share) * upto)]:
            s = sample(INDEX[k])
            w.add(k, tensors=s["tensors"], files=s["files"], meta=s["meta"])
            written.add(k)
        w.finish_rank()  # its shards committed; the others' too, but no commit: the run was killed
        w.close()
    return written


def resume(store: Store, world: int) -> tuple[list[set[str]], list[list[str]]]:
    """Every rank of `world` opens the version with its share, all at once (the verdict agreed by all, as encode's
    all-reduce does); returns each rank's committed keys and the index files each one read."""
    verdicts: list[bool] = [False] * world
    barrier = threading.Barrier(world)
    read: dict[str, list[str]] = {}
    real = writer_open.index_keys

    def counted(p):
        read.setdefault(threading.current_thread().name, []).append(p.name)
        return real(p)

    def agree_of(rank: int):
        def agree(alone: bool) -> bool:
            verdicts[rank] = alone
            barrier.wait()
            return all(verdicts)
        return agree

    done: list[set[str]] = [set()] * world

    def run(rank: int) -> None:
        w = store.writer("vae", vae_schema(), rank=rank, world_size=world, shard_size_mb=0.002, version=1,
                         share=shares(world)[rank], agree=agree_of(rank))
        done[rank] = w.done_keys
        w.close()

    with mock.patch.object(writer_open, "index_keys", counted):
        threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return done, [read.get(f"rank{r}", []) for r in range(world)]


def finish(store: Store, world: int, done: list[set[str]]) -> None:
    """Each rank writes what its share lacks; rank 0 commits (the merge refuses a key committed twice)."""
    writers = [store.writer("vae", vae_schema(), rank=r, world_size=world, shard_size_mb=0.002, version=1,
                            share=shares(world)[r], agree=lambda alone: False)  # every index read: the same answer
               for r in range(world)]
    for rank, w in enumerate(writers):
        assert w.done_keys == done[rank]
        for k in shares(world)[rank]:
            if k not in w.done_keys:
                s = sample(INDEX[k])
                w.add(k, tensors=s["tensors"], files=s["files"], meta=s["meta"])
        if rank:
            w.finish_rank()
    writers[0].commit()


def test_a_resume_with_the_same_world_size_reads_each_rank_s_own_indexes_only(store: Store) -> None:
    written = write_part(store, 3, upto=0.6)
    done, read = resume(store, 3)
    for rank, share in enumerate(shares(3)):
        assert done[rank] == written & set(share)
        assert read[rank] and all(name.startswith(f"shard-r{rank:02d}-") for name in read[rank]), read[rank]
    finish(store, 3, done)
    r = store.reader("vae")
    assert sorted(r.keys()) == sorted(key_of(i) for i in range(N)) and len(r.manifest) == N


@pytest.mark.parametrize("before, after", [(3, 2), (2, 3), (2, 1), (1, 4)])
def test_a_resume_with_another_world_size_finds_every_committed_key_of_the_new_shares(store: Store, before: int,
                                                                                        after: int) -> None:
    written = write_part(store, before, upto=0.5)
    done, read = resume(store, after)
    everything = sorted(p.name for p in (store.root / "vae" / "v1").glob("*.index.parquet"))
    for rank, share in enumerate(shares(after)):
        assert done[rank] == written & set(share)  # nothing committed written again, nothing skipped unwritten
        assert sorted(read[rank]) == everything  # each once
    finish(store, after, done)  # the commit refuses a key committed twice
    r = store.reader("vae")
    assert sorted(r.keys()) == sorted(key_of(i) for i in range(N)) and len(r.manifest) == N


def test_one_process_reads_every_index_only_when_another_rank_wrote(store: Store) -> None:
    write_part(store, 1, upto=0.5)
    w = store.writer("vae", vae_schema(), rank=0, world_size=1, version=1, share=shares(1)[0])
    assert w.done_keys == {key_of(i) for i in range(N // 2)}
    w.close()
