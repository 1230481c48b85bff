"""One epoch's plan - every rank's batches of every global step - as two numpy arrays instead of nested lists.

Each rank plans the whole epoch (the trainer and the check-ahead walkers read other ranks' batches too) and keeps
two plans (`DataStream.KEPT_PLANS`): at 1M samples on 8 ranks the nested Python lists held ~56 MB per plan (a
list object per batch, an int object per index), these arrays ~4-8 MB (bench/epoch_plan.py). Read as before:
`plan[k][r]` is rank r's k-th batch as a list of ints, `len(plan)` the number of steps; a batch's list is made
when it is read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class EpochPlan(Sequence):
    """`samples`: every batch's indices back to back, step by step, rank by rank within a step; `sizes`: each
    batch's length in that order (world_size per step)."""

    def __init__(self, samples, sizes, world_size: int):
        samples, sizes = np.asarray(samples), np.asarray(sizes, dtype=np.int64)
        if len(sizes) % world_size or int(sizes.sum()) != len(samples):
            raise ValueError(f"{len(sizes)} batches of {int(sizes.sum())} samples are not whole steps of "
                             f"{world_size} batches over {len(samples)} samples")
        # int32 while the indices fit: half the bytes of int64 (2³¹ samples is beyond any store here)
        small = len(samples) == 0 or int(samples.max()) < 2**31
        self.samples = samples.astype(np.int32 if small else np.int64, copy=False)
        self.bounds = np.concatenate(([0], np.cumsum(sizes)))
        self.world_size = world_size

    @classmethod
    def uniform(cls, steps: np.ndarray) -> EpochPlan:
        """From a (steps, world_size, batch_size) array: every batch the same size."""
        n, w, b = steps.shape
        return cls(steps.reshape(-1), np.full(n * w, b, dtype=np.int64), w)

    @classmethod
    def from_lists(cls, steps: list[list[list[int]]], world_size: int) -> EpochPlan:
        sizes = [len(b) for step in steps for b in step]
        flat = np.fromiter((i for step in steps for b in step for i in b), dtype=np.int64, count=sum(sizes))
        return cls(flat, sizes, world_size)

    def __len__(self) -> int:
        return (len(self.bounds) - 1) // self.world_size

    def batch(self, k: int, rank: int) -> list[int]:
        j = k * self.world_size + rank
        return self.samples[self.bounds[j]:self.bounds[j + 1]].tolist()

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        n = len(self)
        if not -n <= k < n:
            raise IndexError(f"step {k} of an epoch of {n} steps")
        k %= n
        return [self.batch(k, r) for r in range(self.world_size)]

    def tolist(self) -> list[list[list[int]]]:
        return list(self)

    def __eq__(self, other) -> bool:
        if isinstance(other, EpochPlan):
            return (self.world_size == other.world_size and np.array_equal(self.bounds, other.bounds)
                    and np.array_equal(self.samples, other.samples))
        if isinstance(other, list):
            return self.tolist() == other
        return NotImplemented

    __hash__ = None  # mutable arrays inside, like a list
