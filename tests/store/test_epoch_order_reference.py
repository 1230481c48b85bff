"""The epoch order (which keys a rank reads, in which order) is part of a run's identity: a resumed encode or
training run skips by it. The order worked out on row numbers (store/partition.py `epoch_positions`,
`TableReader.epoch_keys`) must equal, bit for bit, the former one built from Python lists of keys (kept verbatim
in bench/epoch_keys.py, its baseline) on random tables, splits, joins, seeds and world sizes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pytest

# the reference: store/ at c4c67e3, verbatim, kept once as the baseline of bench/epoch_keys.py
from bench.epoch_keys import old_epoch_order, old_iter_keys, old_joined_iter_keys, old_shard_groups
from store import Store
from store.join import JoinedTables
from store.partition import epoch_order
from store.reader import TableReader
from store_samples import fill, key_of, sample, vae_schema

# ------------------------------------------------------------ random inputs

def random_reader(root: Path, table: str, keys: list[str], rng: random.Random) -> TableReader:
    """A reader over a hand-made manifest: random shard of each key (names whose sorted order is not the order
    they first appear in), random split with missing values, rows sorted by key or not."""
    vdir = root / table / "v1"
    vdir.mkdir(parents=True)
    (vdir / "schema.json").write_text(json.dumps(vae_schema().to_dict()))
    names = [f"shard-r{rng.randrange(12):02d}-{rng.randrange(40):06d}.tar" for _ in range(rng.randint(1, 25))]
    rows = sorted(keys) if rng.random() < 0.7 else rng.sample(keys, len(keys))
    n = len(rows)
    manifest = pa.table({
        "key": pa.array(rows, pa.string()),
        "shard": pa.array([rng.choice(names) for _ in range(n)], pa.string()),
        "shard_nbytes": pa.array([0] * n, pa.int64()),
        "split": pa.array([rng.choice(["train", "train", "val", None]) for _ in range(n)], pa.string()),
    })
    return TableReader.over_manifest(vdir, table, 1, manifest)


def random_keys(rng: random.Random, n: int, fixed: bool) -> list[str]:
    if fixed:  # content hashes, the usual keys: the join's binary-search path
        return [f"{rng.getrandbits(128):032x}" for _ in range(n)]
    return [f"k{rng.getrandbits(20):x}_{i}" for i in range(n)]


def orders(rng: random.Random):
    for _ in range(6):
        ws = rng.choice([1, 2, 3, 5, 8])
        yield (rng.randrange(ws), ws, rng.choice([None, 0, rng.randrange(10**6)]), rng.randrange(4),
               rng.choice([1, 2, 7, 1024]))


@pytest.mark.parametrize("case", range(40))
def test_reader_and_join_orders_equal_the_former_ones(tmp_path: Path, case: int) -> None:
    rng = random.Random(case)
    fixed = case % 2 == 0
    keys = random_keys(rng, rng.choice([0, 1, 5, 60, 300]), fixed)
    a = random_reader(tmp_path / "a", "vae", keys, rng)
    # the second table: most keys in common, some of its own (the join drops keys on one side only)
    others = [k for k in keys if rng.random() < 0.85] + random_keys(rng, rng.randint(0, 20), fixed)
    b = random_reader(tmp_path / "b", "text", others, rng)
    for split in (None, "train", "val"):
        assert a.shard_groups(split) == old_shard_groups(a, split)
        for rank, ws, seed, epoch, buf in orders(rng):
            assert a.iter_keys(split, rank, ws, seed, epoch, buf) == old_iter_keys(a, split, rank, ws, seed, epoch, buf)
        for first, second in ((a, b), (b, a)):
            j = JoinedTables({first.table: first, second.table: second}, split, store_root=tmp_path)
            for rank, ws, seed, epoch, buf in orders(rng):
                assert j.iter_keys(rank, ws, seed, epoch, buf) == old_joined_iter_keys(j, rank, ws, seed, epoch, buf)


def test_epoch_order_of_lists_equals_the_former_one() -> None:
    rng = random.Random(0)
    for _ in range(300):
        groups = [list(range(rng.randint(0, 9))) for _ in range(rng.randint(0, 30))]  # empty groups too
        for rank, ws, seed, epoch, buf in orders(rng):
            want = old_epoch_order(groups, rank, ws, seed, epoch, buf)
            assert epoch_order(groups, rank, ws, seed, epoch, buf) == want


def test_a_written_table_orders_as_before(store: Store) -> None:
    """A table written as the stages write it (several ranks, small shards, dictionary-encoded shard column)."""
    fill(store, 40, shard_size_mb=0.002)
    w = store.writer("vae", vae_schema("b"), rank=1, world_size=2, shard_size_mb=0.002)
    for i in random.Random(1).sample(range(40, 80), 40):
        s = sample(i)
        w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    w.finish_rank()
    w0 = store.writer("vae", vae_schema("b"), rank=0, world_size=2, shard_size_mb=0.002)
    w0.add(key_of(0), tensors=sample(0)["tensors"], files=sample(0)["files"], meta=sample(0)["meta"])
    w0.commit()
    r = store.reader("vae")
    assert len(r.view.samples.shard_numbers()[1]) > 5
    rng = random.Random(2)
    for split in (None, "train", "val"):
        for rank, ws, seed, epoch, buf in orders(rng):
            assert r.iter_keys(split, rank, ws, seed, epoch, buf) == old_iter_keys(r, split, rank, ws, seed, epoch, buf)
