"""Rank partitioning and shuffling: pure functions of integers (and the shard grouping), no hidden state.

Order for one epoch: shards permuted by (seed, epoch) -> samples flattened -> contiguous slice per rank
(sizes differ by at most one) -> a bounded shuffle buffer per rank seeded by (seed, epoch, rank).
Shard-level order keeps reads sequential; the buffer mixes samples across neighbouring shards.
"""

from __future__ import annotations

import hashlib
import random
from typing import Sequence, TypeVar

import numpy as np

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


def epoch_positions(
    sizes: Sequence[int] | np.ndarray, rank: int = 0, world_size: int = 1,
    seed: int | None = None, epoch: int = 0, buffer_size: int = 1024,
) -> np.ndarray:
    """This rank's items for one epoch as positions in the stored (unshuffled) flattening of groups of `sizes`.
    Integers only: a caller turns just its own share into keys, not every rank's (1M str per rank at scale)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    start, stop = rank_slice(total, rank, world_size)
    if seed is None:
        return np.arange(start, stop, dtype=np.int64)
    order = list(range(len(sizes)))
    rng_for(seed, epoch).shuffle(order)  # whole groups (shards) permuted, each group's inner order kept
    perm = np.asarray(order, dtype=np.int64)
    firsts = (np.cumsum(sizes) - sizes)[perm]  # where each permuted group starts in the stored order
    lens = sizes[perm]
    flat = np.repeat(firsts - (np.cumsum(lens) - lens), lens) + np.arange(total, dtype=np.int64)
    mine = flat[start:stop].tolist()
    return np.asarray(buffer_shuffle(mine, buffer_size, rng_for(seed, epoch, rank)), dtype=np.int64)


def epoch_order(
    groups: Sequence[Sequence[T]], rank: int = 0, world_size: int = 1,
    seed: int | None = None, epoch: int = 0, buffer_size: int = 1024,
) -> list[T]:
    """This rank's items for one epoch. seed=None: the stored order, split contiguously."""
    flat = [x for g in groups for x in g]
    return [flat[i] for i in epoch_positions([len(g) for g in groups], rank, world_size, seed, epoch,
                                             buffer_size).tolist()]
