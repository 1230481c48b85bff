"""Length-aware batch sampler: mixes resolutions across batches while keeping padding inside a batch low.

Pure functions of integers (no torch), so partitioning and shuffling are tested exhaustively (STYLE habit 4).

Per epoch, from (seed, epoch) alone:
1. shuffle all indices (with drop_last, the tail that cannot fill a whole global step is dropped);
2. cut the shuffled order into windows of `window` global steps (a global step = world_size batches of
   batch_size), sort each window by length, and cut it into consecutive global steps, each step into one
   batch per rank — neighbours in length share a batch, so padding stays small;
3. shuffle the order of the global steps, so consecutive batches still mix resolutions;
4. without drop_last the leftover samples form one last step, split over the ranks as evenly as possible
   (when fewer leftovers than ranks remain, `tail_apart`: one sample a batch, the ranks left over an empty batch,
   on which the trainer runs a zero-weight stand-in, `stages/train/prefetch.py::prepare_share`; runs planned
   before it: they join the last full step, whose batches then hold batch_size + 1 samples, one more than the
   run was sized for - twice the activations at batch_size 1) — every index appears exactly once per epoch
   across ranks and every rank gets the same number of batches (DDP steps in lockstep).
Resume: the epoch's steps are a pure function of (seed, epoch), so (epoch, batch) - the trainer's data position -
continues with exactly the batches an uninterrupted run would see. Randomness and rank slices are
`store.partition`'s (the project's one partition/shuffle scheme).
"""

from __future__ import annotations

import numpy as np

from stages.train.epoch_plan import EpochPlan
from store.partition import rank_slice, rng_for


class LengthAwareBatchSampler:
    """Every rank's batches of an epoch, deterministic from (seed, epoch); the trainer's `DataStream` walks them."""

    def __init__(
        self,
        lengths: list[int],
        batch_size: int,
        seed: int,
        window: int = 64,
        drop_last: bool = False,
        world_size: int = 1,
        tail_apart: bool = False,
    ):
        if batch_size < 1 or window < 1 or world_size < 1:
            raise ValueError(f"batch_size ({batch_size}), window ({window}) and world_size ({world_size}) must be >= 1")
        if not drop_last and 0 < len(lengths) < world_size:
            raise ValueError(f"{len(lengths)} samples cannot give every one of {world_size} processes a batch")
        # numbers, not a list of Python ints (~36 MB at 1M samples in every rank); the join's array is shared
        self.lengths = self._lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size = batch_size
        self.seed = seed
        self.window = window
        self.drop_last = drop_last
        self.world_size = world_size
        self.tail_apart = tail_apart  # a tail of fewer samples than ranks is a step of its own (runs started now)

    def global_steps(self, epoch: int) -> EpochPlan:
        """All ranks' batches: steps[k][r] is rank r's k-th batch of the epoch."""
        # numpy, seeded from store.partition's generator: a million-sample epoch plan in well under a second
        # (the same steps in Python lists took ~20x longer).
        rng = np.random.default_rng(rng_for(self.seed, epoch).getrandbits(64))
        order = rng.permutation(len(self.lengths))
        per_step = self.batch_size * self.world_size
        if self.drop_last:
            order = order[: len(order) - len(order) % per_step]
        n_full = len(order) // per_step
        full = order[: n_full * per_step]
        # Sort each window of `window` global steps by length; lexsort is stable: equal lengths keep their
        # shuffled order, so ties are mixed too.
        window_of = np.arange(len(full)) // (self.window * per_step)
        full = full[np.lexsort((self._lengths[full], window_of))]
        # kept as arrays (`EpochPlan`): the nested lists of a 1M-sample plan held ~56 MB in every rank
        grid = full.reshape(n_full, self.world_size, self.batch_size)[rng.permutation(n_full)]
        tail = order[n_full * per_step :]
        if not len(tail):
            return EpochPlan.uniform(grid)
        if len(tail) < self.world_size and not self.tail_apart:
            # Too few for one batch per rank (runs planned before `tail_apart`): they join the last full step
            # (batches of size B or B+1).
            tail, grid = np.concatenate([tail, grid[-1].reshape(-1)]), grid[:-1]
        tail = tail[np.argsort(self._lengths[tail], kind="stable")]
        shares = [stop - start for start, stop in (rank_slice(len(tail), r, self.world_size)
                                                   for r in range(self.world_size))]
        sizes = np.concatenate([np.full(grid.shape[0] * self.world_size, self.batch_size), shares])
        return EpochPlan(np.concatenate([grid.reshape(-1), tail]), sizes, self.world_size)


def padded_tokens(batches: list[list[int]], lengths, power: int = 1) -> tuple[int, int]:
    """(valid, computed) tokens of `batches`, each padded to its longest (an empty one, a stand-in's: none); with
    `power` 2, each sample's count squared (attention's cost)."""
    valid = computed = 0
    for batch in batches:
        if batch:
            ls = [int(lengths[i]) ** power for i in batch]
            valid += sum(ls)
            computed += max(ls) * len(ls)
    return valid, computed


def padding_efficiency(batches: list[list[int]], lengths) -> tuple[float, float]:
    """(valid / computed tokens, the same weighted by sequence length²), each batch padded to its longest."""
    valid, computed = padded_tokens(batches, lengths)
    if computed == 0:
        return 1.0, 1.0
    valid_sq, computed_sq = padded_tokens(batches, lengths, power=2)
    return valid / computed, valid_sq / computed_sq


def random_batches(n: int, batch_size: int, seed: int) -> list[list[int]]:
    """Plain shuffled batching, the baseline `padding_efficiency` is compared against."""
    rng = rng_for(seed)
    order = list(range(n))
    rng.shuffle(order)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]
