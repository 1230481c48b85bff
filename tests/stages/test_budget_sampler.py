"""Token-budget sampler: pure partition / budget / resume properties, exhaustive over sizes, ranks, budgets."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from stages.train.budget import (NUMPY_SHUFFLE, PYTHON_SHUFFLE, TAIL_IN_BUDGET, TokenBudgetBatchSampler,
                                 computed_fill, make_sampler)
from stages.train.data import DataStream
from stages.train.sampler import LengthAwareBatchSampler, padding_efficiency

SIZES = [1, 2, 3, 5, 8, 13, 31, 64, 100]


def random_lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([64, 144, 256, 576, 1024]) + rng.randint(0, 40) for _ in range(n)]


def cost(batch: list[int], lengths: list[int]) -> int:
    return len(batch) * max(lengths[i] for i in batch)


def test_every_index_once_disjoint_ranks_lockstep_and_within_budget():
    cases = short_tails = 0
    for n, world, budget, window, seed in itertools.product(SIZES, [1, 2, 3, 4], [1064, 2200, 6000], [1, 4, 64], [0, 1]):
        lengths = random_lengths(n, seed)
        if n < world:
            with pytest.raises(ValueError):
                TokenBudgetBatchSampler(lengths, budget, seed, world_size=world)
            continue
        steps = TokenBudgetBatchSampler(lengths, budget, seed, window=window, world_size=world).global_steps(seed % 3)
        assert all(len(step) == world for step in steps), "every step gives every rank one batch"
        counts = Counter(i for step in steps for b in step for i in b)
        assert set(counts) == set(range(n)) and set(counts.values()) == {1}, "each index exactly once per epoch"
        assert all(cost(b, lengths) <= budget for step in steps for b in step if b), "every batch within budget"
        # Empty batches (a zero-weight stand-in in training) only in the last step, and only when the leftovers had
        # fewer samples than ranks: then each of those samples is a batch of its own.
        empty = [k for k, step in enumerate(steps) if not all(step)]
        assert empty in ([], [len(steps) - 1])
        if empty:
            assert world > 1 and all(len(b) <= 1 for b in steps[-1]) and steps[-1][0]
            short_tails += 1
        cases += 1
    assert cases > 500 and 0 < short_tails < cases // 4  # the short tail is exercised, and rare


def test_a_short_tail_never_takes_a_batch_over_the_budget():
    """Leftovers of fewer samples than ranks - the last window's longest samples, one a batch under a budget near
    the longest sample - used to join the last full step one per batch: a 16000-token sample joining a batch of 16
    short ones made 17 x 16000 computed tokens on a budget of 16384 (an out-of-memory at an epoch's end that
    `pipeline plan`, which plans a micro-batch at the budget, could not foresee). Now they are a step of their
    own, and the ranks left over run a zero-weight stand-in. Runs planned before keep their plans (below)."""
    rng = random.Random(2)
    lengths = [rng.choice([1000, 1200]) if rng.random() < 0.7 else rng.choice([12000, 16000]) for _ in range(117)]
    worst = {}
    for shuffle in (NUMPY_SHUFFLE, TAIL_IN_BUDGET):
        s = TokenBudgetBatchSampler(lengths, 16384, 7, window=4, world_size=16, shuffle=shuffle)
        worst[shuffle] = max(cost(b, lengths) for e in range(8) for step in s.global_steps(e) for b in step if b)
    assert worst[NUMPY_SHUFFLE] > 4 * 16384  # the earlier plans (pinned below): far over the budget
    assert worst[TAIL_IN_BUDGET] <= 16384
    assert TokenBudgetBatchSampler(lengths, 16384, 7, world_size=16).shuffle == TAIL_IN_BUDGET  # runs started now


def test_deterministic_differs_across_epochs_and_resumes_from_any_position():
    lengths = random_lengths(90, 5)
    for world, budget in itertools.product([1, 2, 3], [1100, 4000]):
        a = TokenBudgetBatchSampler(lengths, budget, seed=3, window=2, world_size=world)
        b = TokenBudgetBatchSampler(list(lengths), budget, seed=3, window=2, world_size=world)
        assert a.global_steps(1) == b.global_steps(1)
        assert a.global_steps(0) != a.global_steps(1)
        straight = DataStream(a, epoch=1)
        n1 = len(a.global_steps(1))
        seen = [straight.next() for _ in range(n1 + 5)]  # into epoch 2 as well
        for start in range(n1):
            resumed = DataStream(TokenBudgetBatchSampler(lengths, budget, seed=3, window=2, world_size=world), 1, start)
            assert [resumed.next() for _ in range(len(seen) - start)] == seen[start:]


def test_fills_the_budget_with_little_padding_and_mixes_sizes():
    rng = random.Random(0)
    lengths = [rng.choice([1024, 1536, 2304, 4096, 8192, 12288, 16384]) + rng.randint(0, 400) for _ in range(3000)]
    sampler = TokenBudgetBatchSampler(lengths, 98304, seed=0)
    steps = sampler.global_steps(0)
    batches = [s[0] for s in steps]
    linear, _ = padding_efficiency(batches, lengths)
    assert linear > 0.97 and computed_fill(steps, lengths, 98304) > 0.85
    sizes = [len(b) for b in batches]
    assert max(sizes) >= 4 * min(sizes)  # short samples make big batches, long ones small batches
    longest = [max(lengths[i] for i in b) for b in batches[:40]]
    assert max(longest) > 12000 and min(longest) < 3000  # large and small images early in the epoch


def test_rejects_a_budget_below_the_longest_sample_and_make_sampler_picks_the_kind():
    with pytest.raises(ValueError, match="longest sample"):
        TokenBudgetBatchSampler([10, 500], 499, seed=0)
    assert isinstance(make_sampler([1, 2], 2, None, 0, 4, 1), LengthAwareBatchSampler)
    assert isinstance(make_sampler([1, 2], 2, 10, 0, 4, 1), TokenBudgetBatchSampler)
    assert TokenBudgetBatchSampler([], 10, seed=0).global_steps(0) == []
    assert computed_fill([[[0, 1]], [[2]]], [5, 5, 10], 10) == pytest.approx((10 + 10) / 20)


def test_the_plan_is_the_one_runs_were_trained_with():
    """A resume continues the order an earlier start planned: the plan of a fixed input stays what the code
    computed before (pinned; the per-sample loop now reads Python ints instead of numpy scalars, ~2x faster), for the
    runs started with Python's shuffles and for those started with numpy's."""
    import hashlib
    import json

    rng = random.Random(7)
    lengths = [rng.choice([64, 144, 256, 576, 1024]) + rng.randint(0, 40) for _ in range(5000)]
    s = TokenBudgetBatchSampler(lengths, 3000, 5, window=4, world_size=3, shuffle=PYTHON_SHUFFLE)
    plan = json.dumps([s.global_steps(e).tolist() for e in range(2)]).encode()
    assert hashlib.sha256(plan).hexdigest()[:16] == "c4c37f3d84218ea7"
    s = TokenBudgetBatchSampler(lengths, 3000, 5, window=4, world_size=3, shuffle=NUMPY_SHUFFLE)  # numpy's shuffles
    plan = json.dumps([s.global_steps(e).tolist() for e in range(2)]).encode()
    assert hashlib.sha256(plan).hexdigest()[:16] == "c6d08f99deac0918"


def test_plans_of_every_tail_case_are_the_ones_runs_were_trained_with():
    """Sizes and world sizes that reach every tail case (halved leftovers, leftovers joining the last full
    step, no leftovers): the plans are the nested lists the code computed before it kept them as arrays."""
    import hashlib
    import json

    rng = random.Random(7)
    lengths = [rng.choice([64, 144, 256, 576, 1024]) + rng.randint(0, 40) for _ in range(5000)]
    for shuffle, pinned in ((PYTHON_SHUFFLE, "917abbf498af95c5"), (NUMPY_SHUFFLE, "af932be429362b98"),
                            (TAIL_IN_BUDGET, "1b980bc4b1b47b41")):  # the last: runs started now (a short tail's own step)
        plans = []
        for n, world in itertools.product([5000, 4999, 37, 5, 3], [1, 3, 8]):
            if n >= world:
                s = TokenBudgetBatchSampler(lengths[:n], 3000, 5, window=4, world_size=world, shuffle=shuffle)
                plans.append([s.global_steps(e).tolist() for e in range(2)])
        assert hashlib.sha256(json.dumps(plans).encode()).hexdigest()[:16] == pinned, shuffle


@pytest.mark.parametrize("budget", [None, 10])
def test_fewer_samples_than_processes_is_one_line(budget):
    """A launch of more processes than the split has samples: the samplers' ValueError reached a launched rank's
    top level as an unexpected error (`rank 0 failed: ValueError: ...` and its traceback); now the UserError every
    rank prints as one line, naming the counts and what to do."""
    from schemas.errors import UserError

    with pytest.raises(UserError, match=r"holds 1 sample\(s\), fewer than the 2 processes.*at most 1 process"):
        make_sampler([3], 2, budget, 0, 4, 2)
    assert len(make_sampler([3, 4], 2, budget, 0, 4, 2).global_steps(0)) == 1


@pytest.mark.parametrize("budget", [10, None])
def test_a_plan_of_a_newer_release_is_one_line(budget):
    """A run whose checkpoints record an epoch plan this release does not know (a newer release started it): the
    token-budget sampler's ValueError was a traceback at the resume; now one line saying which release to finish it
    with. Fixed batches too (since plan 3 places their short tail; an unknown plan had the old join silently)."""
    from schemas.errors import UserError

    with pytest.raises(UserError, match=r"plan 9, which this release does not know.*finish it with that release"):
        make_sampler([3, 4], 2, budget, 0, 4, 1, shuffle=9)


def test_samples_longer_than_the_budget_are_named_by_key_and_tokens():
    """The refusal names the samples over the budget (the longest first, three at most) and the budget to set,
    for training (here) as for validation (tests/stages/test_validation_budget.py); it gave the longest length
    alone, so the user could not tell which samples to resize or drop."""
    from schemas.errors import UserError

    keys = ["a", "b", "c", "d", "e", "f"]
    with pytest.raises(UserError) as refused:
        make_sampler([10, 50, 30, 45, 21, 5], 2, 20, 0, 4, 1, keys=keys)
    line = str(refused.value)
    assert "4 training sample(s)" in line and "b (50 tokens), d (45 tokens), c (30 tokens) and 1 more" in line, line
    assert "at least 50" in line and "\n" not in line
