"""The store cache's running total (store/remote_cache.USAGE) against the S3 test server: a read of many shards
through a cache under `--cache-gb` walks the cache (every file of every cached version) only when the total comes
near the limit, not before every whole-shard fetch; the limit still holds, also with two processes filling it."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import zlib
from pathlib import Path

import torch

from store import Store
from store import format as fmt
from store import remote_cache
from store.remote_cache import USAGE, local_store
from store.remote_shards import fetch_stats, fetcher_for
from store.remote_push import push
from store_samples import fill
import warm_start


def _cache_bytes(cache: Path) -> int:
    """What the cache limit counts: every file but the lock files, in the cache's stores."""
    return sum(p.stat().st_size for d in cache.iterdir() if d.is_dir()
               for p in d.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def _pushed(s3_env, store: Store, n: int) -> str:
    fill(store, n, shard_size_mb=0.012)  # ~3 samples of ~4 KB per shard: many shards, each read by a scan
    push(store.root, s3_env.url())
    return s3_env.url()


def _shard_bytes(store: Store) -> int:
    return max(p.stat().st_size for p in store.root.rglob("*") if fmt.SHARD_RE.fullmatch(p.name))


def _digest(t: dict[str, torch.Tensor]) -> int:
    return zlib.crc32(b"".join(t[n].reshape(-1).view(torch.uint8).numpy().tobytes() for n in sorted(t)))


def test_a_long_read_walks_the_cache_only_near_its_limit(s3_env, store: Store, tmp_path: Path, monkeypatch) -> None:
    url = _pushed(s3_env, store, 96)
    cache = tmp_path / "cache"
    local_store(url, ["vae"], cache)
    limit = _cache_bytes(cache) + 8 * _shard_bytes(store)  # room for a quarter of the shards
    root = local_store(url, ["vae"], cache, limit_gb=limit / 1e9)
    walks, seen = [], []
    real_walk = remote_cache._candidates
    monkeypatch.setattr(remote_cache, "_candidates", lambda *a, **k: walks.append(1) or real_walk(*a, **k))
    before = fetch_stats()
    with store.reader("vae") as local, Store(root, create=False).reader("vae") as cached:
        local_groups = local.shard_groups()
        for _ in range(2):
            for group in local_groups:
                for k in group:
                    assert _digest(cached.tensors(k)) == _digest(local.tensors(k))
                    seen.append(_cache_bytes(cache))
    fetches = fetch_stats()["shards"] - before["shards"]
    fetched_bytes = fetch_stats()["shard_bytes"] - before["shard_bytes"]
    assert fetches >= len(local_groups) + 8  # the second epoch fetched again what the first evicted
    assert max(seen) <= limit
    # before: one walk per whole fetch; now (the first, then) one once at least 1/WALK_FREES - 1/NEAR of the
    # limit has been fetched since the last
    between = limit // remote_cache.WALK_FREES - limit // remote_cache.NEAR
    assert 0 < len(walks) <= 1 + fetched_bytes // between + 1 and len(walks) <= fetches // 2
    assert json.loads((cache / USAGE).read_text())["bytes"] >= _cache_bytes(cache)  # never below the disk's


def test_an_unreadable_running_total_is_rebuilt_by_a_walk(s3_env, store: Store, tmp_path: Path) -> None:
    url = _pushed(s3_env, store, 8)
    cache = tmp_path / "cache"
    local_store(url, ["vae"], cache)
    limit = _cache_bytes(cache) + 4 * _shard_bytes(store)
    root = local_store(url, ["vae"], cache, limit_gb=limit / 1e9)
    (cache / USAGE).write_text('{"byt')  # torn by a process killed while writing it
    with Store(root, create=False).reader("vae") as cached:
        for group in cached.shard_groups():
            for k in group:
                cached.tensors(k)
    assert json.loads((cache / USAGE).read_text())["bytes"] >= _cache_bytes(cache)
    assert _cache_bytes(cache) <= limit


FILLER = textwrap.dedent("""
    import random, sys, zlib
    import torch
    from store import Store, remote_cache
    from store.remote_cache import local_store
    from store.remote_shards import fetch_stats, fetcher_for
    url, cache, limit, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    walks = []
    real = remote_cache._candidates
    remote_cache._candidates = lambda *a, **k: walks.append(1) or real(*a, **k)
    root = local_store(url, ["vae"], cache, limit_gb=limit)
    total = 0
    with Store(root, create=False).reader("vae") as r:
        groups = r.shard_groups()
        for epoch in range(2):
            for g in random.Random(seed + epoch).sample(groups, len(groups)):  # whole shards, in another order
                for k in g:
                    t = r.tensors(k)
                    total += zlib.crc32(b"".join(t[n].reshape(-1).view(torch.uint8).numpy().tobytes()
                                                 for n in sorted(t)))
    print(total, fetch_stats()["shards"], len(walks))
""")


def test_two_processes_filling_one_cache_keep_its_limit(s3_env, store: Store, tmp_path: Path) -> None:
    url = _pushed(s3_env, store, 96)
    cache = tmp_path / "cache"
    local_store(url, ["vae"], cache)
    limit = _cache_bytes(cache) + 8 * _shard_bytes(store)  # a quarter of the shards
    # started warm (tests/warm_start.py, as test_remote_lazy.py's): two processes of their own, without importing
    # torch twice (~9 s of CPU each)
    procs = [warm_start.WarmProcess([sys.executable, "-c", FILLER, url, str(cache), str(limit / 1e9), str(seed)],
                                    env=os.environ.copy())
             for seed in (1, 2)]
    outs = [(out, err) for code, out, err in warm_start.outcomes(procs, timeout=300)]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    with store.reader("vae") as local:
        want = 2 * sum(_digest(local.tensors(k)) for k in local.keys())
    results = [tuple(int(x) for x in out.strip().splitlines()[-1].split()) for out, _ in outs]
    assert [r[0] for r in results] == [want, want]  # each read every sample right, twice
    assert _cache_bytes(cache) <= limit
    assert json.loads((cache / USAGE).read_text())["bytes"] >= _cache_bytes(cache)
    fetches, walks = sum(r[1] for r in results), sum(r[2] for r in results)
    assert fetches >= 32 and walks < fetches  # the processes took room from the shared total, mostly


def test_what_a_process_without_a_limit_fetches_counts_in_the_running_total(s3_env, store: Store,
                                                                           tmp_path: Path) -> None:
    """A process run without --cache-gb filling the same cache (another stage of the node) must add its fetches to
    the node's total: before, a limited process then took the total for the disk's, believed there was room, and
    the cache stayed over its limit by everything the other had fetched. (One process here, its limit set and
    unset as each of the two would run.)"""
    from store import remote_shards

    url = _pushed(s3_env, store, 32)
    cache = tmp_path / "cache"
    local_store(url, ["vae"], cache)
    limit = _cache_bytes(cache) + 4 * _shard_bytes(store)  # half the shards
    root = local_store(url, ["vae"], cache, limit_gb=limit / 1e9)  # the limited process: its walk sets the total
    remote_shards.set_limit(cache, None)  # the other process, no limit: reads every shard
    with Store(root, create=False).reader("vae") as cached:
        groups = cached.shard_groups()
        for group in groups:
            for k in group:
                cached.tensors(k)
        shards = sorted(p for p in fmt.version_dir(root, "vae", 1).iterdir() if fmt.SHARD_RE.fullmatch(p.name))
    assert len(shards) == len(groups) >= 6 and _cache_bytes(cache) > limit
    assert json.loads((cache / USAGE).read_text())["bytes"] >= _cache_bytes(cache)  # counted
    shards[0].unlink()  # the limited process's next read fetches (as after an eviction)
    remote_shards.set_limit(cache, limit)
    with Store(root, create=False).reader("vae") as cached:
        for k in groups[0]:
            cached.tensors(k)
    assert _cache_bytes(cache) <= limit  # its fetch made room: the total said the cache was full


def test_a_fetch_under_way_without_a_limit_is_counted_at_its_full_size_by_a_walk(s3_env, store: Store,
                                                                                 tmp_path: Path) -> None:
    """A limited process's walk sets the node's total to what it counts on disk; a fetch under way in a process
    without --cache-gb had added its bytes to the total, so its file must already count them (created at its full
    size, as a limited process's is): created empty, the walk counted the bytes written so far and the total
    missed the rest for good (the limited process then believed in room the cache no longer had)."""
    from store import remote_shards

    url = _pushed(s3_env, store, 4)
    cache = tmp_path / "cache"
    root = local_store(url, ["vae"], cache, limit_gb=1.0)  # the limited process: metadata
    remote_cache.evict(cache, 10**9, set())  # its walk sets the total (after the open's lease file)
    before = json.loads((cache / USAGE).read_text())["bytes"]
    remote_shards.set_limit(cache, None)  # the other process, no limit, begins a fetch
    vdir = fmt.version_dir(root, "vae", 1)
    fetcher = remote_shards.fetcher_for(vdir)
    shard, entry = next(iter(fetcher.sums.items()))
    part = vdir / f".{shard}{remote_shards.FETCH_TAG}{os.getpid()}-1"
    assert fetcher._reserve(part, int(entry["nbytes"]))
    assert json.loads((cache / USAGE).read_text())["bytes"] == before + int(entry["nbytes"])  # added
    remote_cache.evict(cache, 10**9, set())  # the limited process walks meanwhile (its fetches came near its limit)
    assert json.loads((cache / USAGE).read_text())["bytes"] == before + int(entry["nbytes"])  # still counted


def test_a_shard_larger_than_the_limit_evicts_nothing(s3_env, store: Store, tmp_path: Path) -> None:
    """A shard that cannot fit under --cache-gb is read by range; before, its every read first evicted every cached
    shard (the walk's target, limit - shard, below zero), which the next reads fetched again: with a 2 MB limit,
    a 3 MB disk and a 6 MB `vae` shard, train fetched its `text` shard again and again."""
    url = _pushed(s3_env, store, 8)
    cache = tmp_path / "cache"
    local_store(url, ["vae"], cache)
    limit = _cache_bytes(cache) + 4 * _shard_bytes(store)
    root = local_store(url, ["vae"], cache, limit_gb=limit / 1e9)
    with Store(root, create=False).reader("vae") as cached:
        for k in cached.shard_groups()[0]:  # a scan: its shard fetched whole
            cached.tensors(k)
    kept = [p for p in root.rglob("*") if fmt.SHARD_RE.fullmatch(p.name) and p.suffix == ".tar"]
    assert kept
    with fmt.flock(cache / remote_cache.CACHE_LOCK):
        assert not remote_cache.make_room(cache, limit, limit + 1)
    assert all(p.exists() for p in kept), kept


def test_a_table_read_beside_a_shard_larger_than_the_limit_is_fetched_once(s3_env, store: Store,
                                                                          tmp_path: Path) -> None:
    """Train reads `text` and `vae` in turn. A `vae` shard larger than --cache-gb is read by range, never fetched
    whole, and the `text` shards that fit stay cached: each is fetched once however many times it is read (before,
    each scan read of the big shard emptied the cache, and every `text` scan fetched its shard again)."""
    from dataclasses import replace

    from store_samples import sample, vae_schema

    for table, n, shard_mb in (("text", 9, 0.012), ("vae", 80, 1.0)):  # text: 3 per shard; vae: one shard
        w = store.writer(table, replace(vae_schema(), name=table), shard_size_mb=shard_mb)
        for i in range(n):
            s = sample(i)
            w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
        w.commit()
    push(store.root, s3_env.url())
    cache = tmp_path / "cache"
    local_store(s3_env.url(), ["text", "vae"], cache)
    big = max(p.stat().st_size for p in (store.root / "vae").rglob("*.tar"))
    texts = sum(p.stat().st_size for p in (store.root / "text").rglob("*.tar"))
    limit = _cache_bytes(cache) + texts + 4096  # every text shard fits; the vae shard alone does not
    assert big > limit
    root = local_store(s3_env.url(), ["text", "vae"], cache, limit_gb=limit / 1e9)
    st = Store(root, create=False)
    with st.reader("text") as text, st.reader("vae") as vae:
        text_groups, (vae_keys,) = text.shard_groups(), vae.shard_groups()
        for epoch in range(3):
            for group in text_groups:
                for k in group:  # a scan of one text shard: fetched whole (or read from the cache)
                    text.tensors(k)
                for k in vae_keys[:4]:  # a run of vae reads: a scan, which would fetch its shard whole
                    vae.tensors(k)
    text_fetches, vae_fetches = (fetcher_for(root / t / "v1").stats for t in ("text", "vae"))
    assert text_fetches["shards"] == len(text_groups)  # each text shard once
    assert vae_fetches["shards"] == 0 and vae_fetches["ranges"] == 3 * len(text_groups) * 4  # each vae read: a range
    assert not list((root / "vae").rglob("shard-*.tar"))
