"""Length-aware batch sampler: mixes resolutions across batches while keeping padding inside a batch low.

Pure functions of integers (no torch), so partitioning and shuffling are tested exhaustively (STYLE habit 4).

Per epoch, from (seed, epoch) alone:
1. shuffle all indices (with drop_last, the tail that cannot fill a whole global step is dropped);
2. cut the shuffled order into windows of `window` global steps (a global step = world_size batches of
   batch_size), sort each window by length, and cut it into consecutive global steps, each step into one
   batch per rank — neighbours in length share a batch, so padding stays small;
3. shuffle the order of the global steps, so consecutive batches still mix resolutions;
4. without drop_last the leftover samples form one last step, split over the ranks as evenly as possible
   (when fewer leftovers than ranks remain, they join the last full step, whose batches then hold
   batch_size or batch_size + 1 samples) — every index appears exactly once per epoch across ranks and every
   rank gets the same number of batches (DDP steps in lockstep).
Resume: `set_epoch(epoch, start_batch)` continues with exactly the batches an uninterrupted run would see.
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def _split_even(items: list[int], parts: int) -> list[list[int]]:
    """Contiguous parts whose sizes differ by at most one (larger first)."""
    q, rem = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        size = q + (1 if p < rem else 0)
        out.append(items[start : start + size])
        start += size
    return out


class LengthAwareBatchSampler:
    """Iterable of lists of sample indices for one rank; deterministic from (seed, epoch)."""

    def __init__(
        self,
        lengths: list[int],
        batch_size: int,
        seed: int,
        window: int = 64,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        if batch_size < 1 or window < 1 or world_size < 1:
            raise ValueError(f"batch_size ({batch_size}), window ({window}) and world_size ({world_size}) must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        if not drop_last and 0 < len(lengths) < world_size:
            raise ValueError(f"{len(lengths)} samples cannot give every one of {world_size} processes a batch")
        self.lengths = [int(n) for n in lengths]
        self.batch_size = batch_size
        self.seed = seed
        self.window = window
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch; start_batch > 0 resumes inside it (batches already consumed by this rank)."""
        self.epoch = epoch
        self.start_batch = start_batch

    def global_steps(self, epoch: int) -> list[list[list[int]]]:
        """All ranks' batches: steps[k][r] is rank r's k-th batch of the epoch."""
        rng = random.Random(f"length-aware:{self.seed}:{epoch}")
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        per_step = self.batch_size * self.world_size
        if self.drop_last:
            order = order[: len(order) - len(order) % per_step]
        n_full = len(order) // per_step
        by_length = self.lengths.__getitem__

        steps: list[list[list[int]]] = []
        span = self.window * per_step
        for start in range(0, n_full * per_step, span):
            # Stable sort: equal lengths keep their shuffled order, so ties are mixed too.
            chunk = sorted(order[start : min(start + span, n_full * per_step)], key=by_length)
            for s in range(0, len(chunk), per_step):
                step = chunk[s : s + per_step]
                steps.append([step[r * self.batch_size : (r + 1) * self.batch_size] for r in range(self.world_size)])
        rng.shuffle(steps)

        tail = order[n_full * per_step :]
        if tail:
            if len(tail) < self.world_size:
                # Too few for one batch per rank: they join the last full step (batches of size B or B+1).
                tail = tail + [i for batch in steps.pop() for i in batch]
            steps.append(_split_even(sorted(tail, key=by_length), self.world_size))
        return steps

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches for the epoch, in order."""
        return [step[self.rank] for step in self.global_steps(epoch)]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.epoch_batches(self.epoch)[self.start_batch :]

    def __len__(self) -> int:
        """Batches per rank in a whole epoch (independent of start_batch)."""
        n = len(self.lengths)
        per_step = self.batch_size * self.world_size
        if self.drop_last:
            return n // per_step
        full, rest = divmod(n, per_step)
        if rest == 0:
            return full
        return full + 1 if rest >= self.world_size or full == 0 else full


def padding_efficiency(batches: list[list[int]], lengths: list[int]) -> tuple[float, float]:
    """(valid / computed tokens, the same weighted by sequence length²), each batch padded to its longest."""
    valid = computed = valid_sq = computed_sq = 0
    for batch in batches:
        if not batch:
            continue
        ls = [lengths[i] for i in batch]
        longest = max(ls)
        valid += sum(ls)
        computed += longest * len(ls)
        valid_sq += sum(n * n for n in ls)
        computed_sq += longest * longest * len(ls)
    if computed == 0:
        return 1.0, 1.0
    return valid / computed, valid_sq / computed_sq


def random_batches(n: int, batch_size: int, seed: int) -> list[list[int]]:
    """Plain shuffled batching, the baseline `padding_efficiency` is compared against."""
    rng = random.Random(f"random:{seed}")
    order = list(range(n))
    rng.shuffle(order)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]
