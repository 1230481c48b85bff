"""Token-budget batches: each batch holds as many samples as fit in `max_tokens` computed tokens.

Computed tokens of a batch = batch size x its longest sequence (what a padded batch costs), so a batch of
512² targets without controls holds many samples and one of 1024² targets with 3 controls holds few, and the
GPU does about the same work every step. Pure functions of integers (no torch), like `sampler.py`, and the same
interface (`global_steps(epoch)` -> steps[k][rank] = a batch), so `DataStream`, its (epoch, batch) resume
position and the trainer's loss scaling (world_size / samples in the step) work unchanged.

Per epoch, from (seed, epoch) alone:
1. shuffle all indices;
2. cut the order into windows of `window` global steps' worth of samples (estimated from the mean length), sort
   each window by length and cut it greedily into batches: a batch grows while (size + 1) x longest <= budget
   (sorted, so the longest is the newest; for consecutive runs of a sorted list greedy gives the fewest
   batches, i.e. the fullest);
3. group consecutive batches (similar cost) into global steps of one batch per rank, shuffle the steps' order;
4. the leftover batches (fewer than ranks) are split, largest first, into halves until there is one per rank:
   every half of a batch within budget is within budget. Only when the leftovers hold fewer samples than there
   are ranks do their samples join the last full step, one per batch (that one step may then exceed the budget
   by one sample per batch) - every index still appears exactly once per epoch and every rank gets the same
   number of batches (DDP steps in lockstep).
A sample longer than the budget is an error: the budget must hold the longest sample.
"""

from __future__ import annotations

import numpy as np

from store.partition import rng_for


class TokenBudgetBatchSampler:
    """Every rank's batches of an epoch under a computed-token budget, deterministic from (seed, epoch)."""

    def __init__(self, lengths: list[int], max_tokens: int, seed: int, window: int = 64, world_size: int = 1):
        if max_tokens < 1 or window < 1 or world_size < 1:
            raise ValueError(f"max_tokens ({max_tokens}), window ({window}) and world_size ({world_size}) must be >= 1")
        if 0 < len(lengths) < world_size:
            raise ValueError(f"{len(lengths)} samples cannot give every one of {world_size} processes a batch")
        longest = max(lengths, default=0)
        if longest > max_tokens:
            raise ValueError(f"the longest sample has {longest} tokens, more than the budget of {max_tokens} per batch")
        self.lengths = np.asarray(lengths, dtype=np.int64)  # shared with the join's array, not a list copy
        self.max_tokens = max_tokens
        self.seed = seed
        self.window = window
        self.world_size = world_size
        mean = int(self.lengths.sum()) / len(self.lengths) if len(self.lengths) else 1
        # A window of `window` global steps, in samples: mean batch size estimated from the mean length.
        self.window_samples = window * world_size * max(1, int(max_tokens // mean))

    def _batches(self, order: list[int]) -> list[list[int]]:
        """Greedy fill of each sorted window."""
        lengths = self.lengths.tolist()  # Python ints for the per-sample loop: numpy scalar reads took half the plan
        by_length = lengths.__getitem__
        batches: list[list[int]] = []
        for start in range(0, len(order), self.window_samples):
            # Stable sort: equal lengths keep their shuffled order, so ties are mixed too.
            batch: list[int] = []
            for i in sorted(order[start : start + self.window_samples], key=by_length):
                if batch and (len(batch) + 1) * lengths[i] > self.max_tokens:
                    batches.append(batch)
                    batch = []
                batch.append(i)
            if batch:
                batches.append(batch)
        return batches

    def global_steps(self, epoch: int) -> list[list[list[int]]]:
        """All ranks' batches: steps[k][r] is rank r's k-th batch of the epoch."""
        rng = rng_for(self.seed, epoch)
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        batches = self._batches(order)
        w = self.world_size
        n_full = len(batches) // w
        steps = [batches[k * w : (k + 1) * w] for k in range(n_full)]
        rng.shuffle(steps)
        tail = batches[n_full * w :]
        if not tail:
            return steps
        if sum(len(b) for b in tail) >= w:
            while len(tail) < w:  # halve the batch with the most samples (a half of a batch fits the budget)
                big = max(range(len(tail)), key=lambda j: len(tail[j]))
                b = tail.pop(big)
                tail += [b[: len(b) // 2], b[len(b) // 2 :]]
            steps.append(sorted(tail, key=lambda b: -len(b)))
        else:  # fewer samples than ranks: one each joins a batch of the last full step
            last = steps[-1]
            for j, i in enumerate(i for b in tail for i in b):
                last[j] = last[j] + [i]
        return steps


def computed_fill(steps: list[list[list[int]]], lengths: list[int], max_tokens: int) -> float:
    """Mean computed tokens (batch size x longest) / budget over all batches."""
    batches = [b for step in steps for b in step if b]
    if not batches:
        return 1.0
    return sum(len(b) * max(lengths[i] for i in b) for b in batches) / (len(batches) * max_tokens)


def make_sampler(lengths: list[int], batch_size: int, max_tokens: int | None, seed: int, window: int, world_size: int):
    """`train.max_tokens_per_batch` None: today's fixed `batch_size` batches; else token-budget batches."""
    from stages.train.sampler import LengthAwareBatchSampler

    if max_tokens is None:
        return LengthAwareBatchSampler(lengths, batch_size, seed=seed, window=window, world_size=world_size)
    longest = max(lengths, default=0)
    if longest > max_tokens:
        from schemas.errors import UserError

        raise UserError(
            f"train.max_tokens_per_batch ({max_tokens}) is smaller than the longest training sample ({longest} "
            f"tokens): raise it to at least {longest}"
        )
    return TokenBudgetBatchSampler(lengths, max_tokens, seed=seed, window=window, world_size=world_size)
