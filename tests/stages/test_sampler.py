"""Length-aware batch sampler: pure partition/shuffle properties over many seeds and sizes."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from stages.train.data import DataStream
from stages.train.sampler import LengthAwareBatchSampler, padding_efficiency, random_batches


def random_lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([256, 576, 1024, 2048, 3072, 4096]) + rng.randint(0, 300) for _ in range(n)]


def all_ranks(lengths, batch_size, seed, world_size, epoch=0, **kw) -> list[list[list[int]]]:
    steps = LengthAwareBatchSampler(lengths, batch_size, seed, world_size=world_size, **kw).global_steps(epoch)
    assert all(len(step) == world_size for step in steps)
    return [[step[rank] for step in steps] for rank in range(world_size)]


SIZES = [1, 2, 3, 5, 7, 8, 13, 16, 31, 64, 100]


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_index_once_per_epoch_across_ranks(drop_last):
    cases = 0
    for n, batch_size, world_size, window, seed in itertools.product(SIZES, [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 64], [0, 1, 7]):
        if not drop_last and n < world_size:
            with pytest.raises(ValueError):
                LengthAwareBatchSampler([1] * n, batch_size, seed, world_size=world_size)
            continue
        lengths = random_lengths(n, seed)
        per_rank = all_ranks(lengths, batch_size, seed, world_size, epoch=seed % 3, window=window, drop_last=drop_last)
        counts = Counter(i for batches in per_rank for b in batches for i in b)
        assert all(c == 1 for c in counts.values()), "an index appears twice (within or across ranks)"
        assert len({len(b) for b in per_rank}) == 1, "ranks must run the same number of steps"
        sizes = [len(b) for batches in per_rank for b in batches]
        assert all(s >= 1 for s in sizes)
        if drop_last:
            per_step = batch_size * world_size
            assert len(counts) == n - n % per_step
            assert all(s == batch_size for s in sizes)
        else:
            assert set(counts) == set(range(n))
            # B+1 only when fewer leftovers than ranks had to join the last full step.
            assert all(s <= batch_size + (1 if n % (batch_size * world_size) < world_size else 0) for s in sizes)
        cases += 1
    assert cases > 1000


def test_runs_started_now_never_plan_a_batch_past_batch_size():
    """Leftovers of fewer samples than ranks used to join the last full step (batch_size + 1 samples there: twice
    the activations of a run sized at batch_size 1, an out-of-memory at an epoch's end); runs started now
    (`make_sampler`'s plan 3) give them a step of their own, one sample a batch, and the ranks left over an empty
    batch (a zero-weight stand-in in training). Runs planned before keep the join (the pinned plans below)."""
    from stages.train.budget import NUMPY_SHUFFLE, make_sampler

    cases = short_tails = 0
    for n, batch_size, world_size, seed in itertools.product(SIZES, [1, 2, 3, 4], [1, 2, 3, 4, 8], [0, 1, 7]):
        if n < world_size:
            continue
        lengths = random_lengths(n, seed)
        steps = make_sampler(lengths, batch_size, None, seed, 2, world_size).global_steps(seed % 3)
        counts = Counter(i for step in steps for b in step for i in b)
        assert set(counts) == set(range(n)) and set(counts.values()) == {1}
        assert all(len(step) == world_size and all(len(b) <= batch_size for b in step) for step in steps)
        empty = [k for k, step in enumerate(steps) if not all(step)]
        assert empty in ([], [len(steps) - 1])
        if empty:
            assert n % (batch_size * world_size) < world_size and all(len(b) <= 1 for b in steps[-1])
            short_tails += 1
            before = make_sampler(lengths, batch_size, None, seed, 2, world_size, shuffle=NUMPY_SHUFFLE)
            assert max(len(b) for step in before.global_steps(seed % 3) for b in step) == batch_size + 1
        cases += 1
    assert cases > 400 and short_tails > 50


def test_deterministic_and_differs_across_epochs_and_seeds():
    lengths = random_lengths(200, 3)
    a = LengthAwareBatchSampler(lengths, 4, seed=11)
    b = LengthAwareBatchSampler(list(lengths), 4, seed=11)
    for epoch in range(3):
        assert a.global_steps(epoch) == b.global_steps(epoch)
    assert a.global_steps(0) != a.global_steps(1)
    assert a.global_steps(0) != LengthAwareBatchSampler(lengths, 4, seed=12).global_steps(0)


def test_resume_from_batch_position_gives_the_remaining_batches():
    for seed, n, world_size in itertools.product(range(5), [17, 50, 123], [1, 2, 3]):
        lengths = random_lengths(n, seed)
        sampler = LengthAwareBatchSampler(lengths, 4, seed, window=3, world_size=world_size)
        straight = DataStream(sampler, epoch=2)
        steps = [straight.next() for _ in range(2 * len(sampler.global_steps(2)))]  # into epoch 3 as well
        for start in range(len(sampler.global_steps(2))):  # (epoch, batch) never points past an epoch
            resumed = DataStream(LengthAwareBatchSampler(lengths, 4, seed, window=3, world_size=world_size), 2, start)
            assert [resumed.next() for _ in range(len(steps) - start)] == steps[start:]


def test_keeps_padding_low_while_mixing_resolutions():
    lengths = random_lengths(4000, 0)
    sampler = LengthAwareBatchSampler(lengths, 8, seed=0)
    ours = [step[0] for step in sampler.global_steps(0)]
    linear, quadratic = padding_efficiency(ours, lengths)
    base_linear, base_quadratic = padding_efficiency(random_batches(len(lengths), 8, 0), lengths)
    assert linear > 0.97 and quadratic > 0.95
    assert base_linear < 0.6 and linear > base_linear and quadratic > base_quadratic
    # Batch order is shuffled: consecutive batches are not a sorted sweep through the lengths.
    maxima = [max(lengths[i] for i in b) for b in ours]
    assert maxima != sorted(maxima) and maxima != sorted(maxima, reverse=True)
    first_window = {max(lengths[i] for i in b) >= 3072 for b in ours[:64]}
    assert first_window == {True, False}  # large and small images early in the epoch


def test_padding_efficiency_exact_values():
    lengths = [10, 10, 5, 20, 4]
    linear, quadratic = padding_efficiency([[0, 1], [2, 3], [4]], lengths)
    assert linear == pytest.approx((10 + 10 + 5 + 20 + 4) / (20 + 40 + 4))
    assert quadratic == pytest.approx((100 + 100 + 25 + 400 + 16) / (200 + 800 + 16))
    assert padding_efficiency([], lengths) == (1.0, 1.0)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        LengthAwareBatchSampler([1, 2], 0, seed=0)
    with pytest.raises(ValueError):
        LengthAwareBatchSampler([1, 2], 2, seed=0, world_size=3)
    assert LengthAwareBatchSampler([], 2, seed=0).global_steps(0) == []


def test_each_epoch_is_planned_once_per_rank_for_the_stream_and_its_check_ahead_walkers():
    """The trainer reads the plan (`DataStream.next`) and the check-ahead threads walk it (`read_order`, one walker
    per table): one plan per epoch between them (at 1M samples / 8 ranks a plan takes ~0.2-1 s), and the
    order walked is the order read."""
    import threading

    from stages.train.prefetch import read_order

    class Counting(LengthAwareBatchSampler):
        planned: list[int] = []

        def global_steps(self, epoch):
            self.planned.append(epoch)
            return super().global_steps(epoch)

    sampler = Counting(random_lengths(40, 3), 2, 3, window=2, world_size=2)
    stream = DataStream(sampler, epoch=1, batch=3)
    walkers = [read_order(stream, 1) for _ in range(2)]  # the text and vae tables' check-ahead threads
    # each walker has its first sample (and so epoch 1's plan) before the reader starts, as in training: a
    # walker thread preempted until the reader is two epochs on would plan epoch 1 again (a cache miss, not a bug)
    ahead: list[list[int]] = [[next(w)] for w in walkers]
    threads = [threading.Thread(target=lambda w=w, out=out: out.extend(itertools.islice(w, 29)))
               for w, out in zip(walkers, ahead)]
    for t in threads:
        t.start()
    read = [i for _ in range(25) for i in stream.next()[1][1]]  # 10 steps per epoch: into epoch 3
    for t in threads:
        t.join()
    assert ahead[0] == ahead[1] == read[:30]
    assert Counter(sampler.planned) == {1: 1, 2: 1, 3: 1}


def test_walkers_many_epochs_ahead_never_take_the_plan_being_read():
    """Tiny epochs: a check-ahead walker of 32 samples runs several epochs ahead of the reader (it dropped the
    reader's plan from the stream's cache: KeyError in the trainer's first step)."""
    from stages.train.prefetch import read_order

    stream = DataStream(LengthAwareBatchSampler(random_lengths(8, 0), 2, 0, world_size=2))
    walker = read_order(stream, 0)
    ahead = list(itertools.islice(walker, 32))  # 8 epochs of rank 0's 4 samples
    assert [i for _ in range(16) for i in stream.next()[1][0]] == ahead


def test_plans_are_the_ones_runs_were_trained_with():
    """Sizes, batch sizes, world sizes and drop_last reaching every tail case (none, split over the ranks,
    joining the last full step): the plans are the nested lists the code computed before it kept them as
    arrays, so a resume continues the order an earlier start planned."""
    import hashlib
    import json

    rng = random.Random(7)
    lengths = [rng.choice([64, 144, 256, 576, 1024]) + rng.randint(0, 40) for _ in range(5000)]
    plans = []
    for n, b, w, drop in itertools.product([5000, 4999, 4993, 37, 3], [1, 3, 4], [1, 3, 8], [False, True]):
        if drop or n >= w:
            s = LengthAwareBatchSampler(lengths[:n], b, 5, window=4, world_size=w, drop_last=drop)
            plans.append([s.global_steps(e).tolist() for e in range(2)])
    assert hashlib.sha256(json.dumps(plans).encode()).hexdigest()[:16] == "ca36f37e60feaefa"


@pytest.mark.parametrize("budget", [None, 6000])
def test_an_epoch_plan_holds_a_few_bytes_per_sample(budget):
    """Every rank holds its epoch plans (two at a time): as nested lists a 1M-sample plan took ~56 MB (fixed
    batches) / ~74 MB (token budget) per rank (bench/epoch_plan.py); as arrays ~6."""
    import tracemalloc

    from stages.train.budget import make_sampler

    n = 100_000
    sampler = make_sampler(random_lengths(n, 1), 4, budget, seed=0, window=64, world_size=8)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        plan = sampler.global_steps(0)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert sorted(i for step in plan for b in step for i in b) == list(range(n))
    # int32 indices + an int64 offset per batch; as nested lists ~56-74 bytes per sample
    assert held < 8 * n, f"{held / n:.1f} bytes per sample"
