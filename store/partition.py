"""Rank partitioning and shuffling: pure functions of integers (and the shard grouping), no hidden state.

Order for one epoch: shards permuted by (seed, epoch) -> samples flattened -> contiguous slice per rank
(sizes differ by at most one) -> a bounded shuffle buffer per rank seeded by (seed, epoch, rank).
Shard-level order keeps reads sequential; the buffer mixes samples across neighbouring shards.
"""

from __future__ import annotations

import hashlib
import random
from typing import Sequence, TypeVar

T = TypeVar("T")


def rank_slice(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of rank's share of n items: disjoint, covering, sizes within one of each other."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    return n * rank // world_size, n * (rank + 1) // world_size


def rng_for(*parts: int) -> random.Random:
    """A generator determined only by the integers given (same on every process and Python run)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def shuffle_groups(groups: Sequence[Sequence[T]], seed: int, epoch: int) -> list[T]:
    """Permute whole groups (shards), keep each group's inner order, flatten."""
    order = list(range(len(groups)))
    rng_for(seed, epoch).shuffle(order)
    return [item for g in order for item in groups[g]]


def buffer_shuffle(items: Sequence[T], buffer_size: int, rng: random.Random) -> list[T]:
    """Streaming shuffle: keep `buffer_size` items, emit a random one as each new item arrives."""
    out: list[T] = []
    buf: list[T] = []
    for item in items:
        buf.append(item)
        if len(buf) >= max(1, buffer_size):
            j = rng.randrange(len(buf))
            buf[j], buf[-1] = buf[-1], buf[j]
            out.append(buf.pop())
    rng.shuffle(buf)
    out.extend(buf)
    return out


def epoch_order(
    groups: Sequence[Sequence[T]], rank: int = 0, world_size: int = 1,
    seed: int | None = None, epoch: int = 0, buffer_size: int = 1024,
) -> list[T]:
    """This rank's items for one epoch. seed=None: the stored order, split contiguously."""
    flat = [x for g in groups for x in g] if seed is None else shuffle_groups(groups, seed, epoch)
    start, stop = rank_slice(len(flat), rank, world_size)
    mine = flat[start:stop]
    if seed is None:
        return mine
    return buffer_shuffle(mine, buffer_size, rng_for(seed, epoch, rank))
