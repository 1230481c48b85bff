"""Elastic resume (stages/train/elastic.py): a run planned for W0 processes continued on W, as pure functions of
integers, exhaustive over sample counts, batch sizes / budgets, both world sizes and every resume point."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

from stages.train import elastic, state as train_state
from stages.train.budget import NUMPY_SHUFFLE, PYTHON_SHUFFLE, TokenBudgetBatchSampler
from stages.train.data import DataStream
from stages.train.sampler import LengthAwareBatchSampler

SIZES = [1, 2, 3, 5, 8, 13, 31, 64]
WORLDS = [1, 2, 3, 4, 8]


def random_lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([64, 144, 256, 576, 1024]) + rng.randint(0, 40) for _ in range(n)]


def samplers(n: int, canonical: int, seed: int):
    """Both kinds planned for `canonical` processes (the fixed-size one with several batch sizes; the token-budget
    one with the shuffles of runs started now and of runs started before, which resume with theirs)."""
    lengths = random_lengths(n, seed)
    for batch_size in (1, 2, 3):
        yield LengthAwareBatchSampler(lengths, batch_size, seed, window=2, world_size=canonical)
    for budget, shuffle in itertools.product((1100, 3000), (NUMPY_SHUFFLE, PYTHON_SHUFFLE)):
        yield TokenBudgetBatchSampler(lengths, budget, seed, window=2, world_size=canonical, shuffle=shuffle)


def take(stream: DataStream, count: int) -> list[list[list[int]]]:
    return [stream.next()[1] for _ in range(count)]


def test_every_remaining_sample_once_after_a_world_size_change():
    cases = stand_ins = 0
    for n, canonical, seed in itertools.product(SIZES, WORLDS, [0, 1]):
        if n < canonical:
            continue  # the run could not have started on `canonical` processes
        for sampler in samplers(n, canonical, seed):
            epoch = seed
            planned = sampler.global_steps(epoch)
            for world, stop in itertools.product(WORLDS, range(len(planned))):
                before = take(DataStream(sampler, epoch, 0), stop)  # the first start, on `canonical`
                after_stream = DataStream(elastic.on_world(sampler, world), epoch, stop)  # resumed on `world`
                after = take(after_stream, len(planned) - stop)
                assert after_stream.position == (epoch + 1, 0)  # the epoch ends where the plan does
                counts = Counter(i for step in before + after for batch in step for i in batch)
                assert set(counts) == set(range(n)) and set(counts.values()) == {1}  # each sample once
                assert all(len(step) == world for step in after)  # every rank a batch of every step (lockstep)
                # Each optimizer step trains on the same samples as on `canonical` processes: the same LoRA.
                assert [sorted(i for b in s for i in b) for s in after] == \
                       [sorted(i for b in s for i in b) for s in planned[stop:]]
                if world == canonical:  # nothing changed: exactly the planned batches
                    assert after == planned[stop:]
                else:  # shares within one sample of each other (token-budget steps: of the lowest padded cost,
                    # test_token_budget_shares_...); empty only in a step of fewer samples than ranks
                    if isinstance(sampler, LengthAwareBatchSampler):
                        assert all(max(map(len, s)) - min(map(len, s)) <= 1 for s in after)
                    assert all(all(s) or sum(map(len, s)) < world for s in after)
                    stand_ins += sum(1 for s in after for b in s if not b)
                cases += 1
    assert cases == 10615 and stand_ins > 0


def test_a_second_change_keeps_the_canonical_plan():
    """4 -> 2 -> 8 processes within one epoch: the plan stays the one made for 4 (106 samples at a global batch
    of 12: the last step holds 10, enough for 8 processes)."""
    lengths = random_lengths(106, 3)
    sampler = LengthAwareBatchSampler(lengths, 3, seed=3, world_size=4)
    plan = sampler.global_steps(1)
    seen = take(DataStream(sampler, 1, 0), 3)
    seen += take(DataStream(elastic.on_world(sampler, 2), 1, 3), 4)
    seen += take(DataStream(elastic.on_world(sampler, 8), 1, 7), len(plan) - 7)
    assert [sorted(i for b in s for i in b) for s in seen] == [sorted(i for b in s for i in b) for s in plan]
    assert sorted(i for s in seen for b in s for i in b) == list(range(106))


def test_split_sorts_by_length_and_leaves_empty_shares_only_when_samples_run_short():
    lengths = [50, 10, 40, 20, 30]
    assert elastic.split_step([[0, 1], [2, 3, 4]], 2, lengths) == [[1, 3], [4, 2, 0]]
    shares = elastic.split_step([[0, 1], [2, 3, 4]], 7, lengths)
    assert sorted(map(len, shares)) == [0, 0, 1, 1, 1, 1, 1] and sorted(i for s in shares for i in s) == [0, 1, 2, 3, 4]


def _record(**kw) -> train_state.ResumeRecord:
    base = dict(step=4, epoch=1, batch_in_epoch=2, config_fingerprint="c", tables={"text": "v1"}, store="/s",
                model_fingerprint="m", world_size=4)
    return train_state.ResumeRecord(**{**base, **kw})


def test_record_allows_another_process_count_and_keeps_the_canonical_one(tmp_path):
    saved, now = _record(world_size=4, canonical_world_size=4), _record(world_size=2)
    saved.check_matches(now, tmp_path)  # another process count: no refusal
    with pytest.raises(train_state.ResumeMismatch, match="config fingerprint"):
        saved.check_matches(_record(world_size=2, config_fingerprint="d"), tmp_path)
    for rank in (0, 1):  # a checkpoint holds each rank's RNG state, checksummed by name
        train_state.save_rng(tmp_path, rank, cuda=False)
    train_state.write_record(tmp_path, _record(world_size=2, canonical_world_size=4))
    assert train_state.ResumeRecord.read(tmp_path / train_state.RESUME_JSON).canonical == 4
    # A checkpoint written before elastic resume: its order was planned for the processes that wrote it.
    assert _record(world_size=3).canonical == 3


def test_rng_own_state_on_the_same_world_seeded_after_a_change(tmp_path):
    torch.manual_seed(123)
    saved = torch.get_rng_state()
    save_file({"cpu": saved}, tmp_path / "rng-rank01.safetensors")
    torch.manual_seed(0)
    elastic.restore_rng(tmp_path, 1, same_world=True, seed=7, step=4)
    assert torch.equal(torch.get_rng_state(), saved)

    draws = []
    for rank in (0, 1, 0):  # after a change: from (seed, step, rank), reproducible and different per rank
        elastic.restore_rng(tmp_path, rank, same_world=False, seed=7, step=4)
        draws.append(torch.rand(3))
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])
    assert not torch.equal(torch.get_rng_state(), saved)


def test_change_line_names_both_counts():
    line = elastic.change_line(4, 2, 4)
    assert line.startswith("world size changed 4 -> 2 processes") and "2x as many" in line
    assert line.endswith("so the LoRA is the one a straight run trains")


def test_change_line_with_lora_dropout_does_not_claim_the_straight_runs_lora():
    """LoRA dropout's masks come from each rank's RNG, seeded anew after the change: the line claimed the straight
    run's LoRA all the same."""
    line = elastic.change_line(2, 1, 2, lora_dropout=0.1)
    assert "the LoRA is the one a straight run trains" not in line
    assert line.endswith("train.lora.dropout 0.1's masks are drawn by 1 rank(s) seeded anew: the LoRA is not the one a "
                         "straight run trains")


def _trainable(model: str, tmp_path, n: int):
    """(train config, joined tables of an n-sample store, the transformer with a LoRA whose every weight gets a
    gradient, the LoRA parameters), float32 on the CPU."""
    from models.lora import lora_parameters
    from pipeline.config import load_config
    from stages.train.recipe import setup_transformer
    from train_store import make_train_store, mixed_specs, open_split

    make_train_store(tmp_path / "store", model, mixed_specs(n))
    tc = load_config(None, {"train.device": "cpu", "train.dtype": "float32"}).train
    tables = open_split(tmp_path / "store", model)
    transformer = setup_transformer(model, tc, torch.device("cpu"))
    for name, p in transformer.named_parameters():  # lora_B starts at 0: give every LoRA weight a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p.data, std=0.1)
    return tc, tables, transformer, lora_parameters(transformer)


def test_an_empty_share_trains_a_stand_in_of_zero_loss_and_zero_gradient(tiny_edit_model, tmp_path):
    """The rank with nothing to do in a step runs forward and backward (DDP's all-reduce needs it) on a
    stand-in whose loss and LoRA gradient are exactly 0."""
    from stages.train.prefetch import prepare, prepare_share
    from stages.train.recipe import backward_of

    tc, tables, transformer, params = _trainable(tiny_edit_model, tmp_path, 3)

    real = backward_of(transformer, prepare(tables, tc, [2], 5, torch.device("cpu"), torch.float32), tc,
                       torch.device("cpu"), scale=1.0)
    assert real.item() > 0 and all(p.grad.abs().sum() > 0 for p in params)
    transformer.zero_grad(set_to_none=False)
    stand_in = prepare_share(tables, tc, [], [[2, 0], []], 5, torch.device("cpu"), torch.float32)
    loss = backward_of(transformer, stand_in, tc, torch.device("cpu"), scale=1.0)
    assert loss.tolist() == [0.0]
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)


def _cost(batch: list[int], lengths) -> int:
    """What a padded batch computes: its size x its longest sequence (the token budget's measure)."""
    return len(batch) * max(int(lengths[i]) for i in batch) if batch else 0


def test_token_budget_shares_stay_within_the_budget_on_more_processes():
    """A token-budget run (train.max_tokens_per_batch, tuned to the GPU's memory) resumed on more processes: no
    share may cost more than the budget. Before, a step was cut into shares of equal *counts*: a step planned for
    2 processes as 8 short samples + 1 long one gave the third of 3 processes 2 short + the long one, 3 x the
    long one's cost, 3 budgets (out of memory, and the budget cannot be lowered on resume: it is hashed)."""
    budget = 16384
    lengths = [1024] * 8 + [8192] * 2
    planned = [list(range(8)), [8, 9]]  # 8 x 1024 | 2 x 8192: each batch within the budget
    worst = max(_cost(s, lengths) for s in elastic.split_step(planned, 3, lengths, by_cost=True))
    assert worst <= budget, worst / budget
    checked = 0
    for n, canonical, seed in itertools.product(SIZES + [200], WORLDS, [0, 1, 2]):
        if n < canonical:
            continue
        lengths = random_lengths(n, seed)
        for budget in (1100, 3000, 12000):
            sampler = TokenBudgetBatchSampler(lengths, budget, seed, window=2, world_size=canonical)
            for world in (w for w in WORLDS if w > canonical):
                for planned, split in zip(sampler.global_steps(seed), elastic.on_world(sampler, world).global_steps(seed)):
                    # within the budget, or (the one step the leftovers joined) within what the plan itself had
                    bound = max(budget, max(_cost(b, lengths) for b in planned))
                    assert max(_cost(s, lengths) for s in split) <= bound, (n, canonical, world, budget, split)
                    checked += 1
    assert checked > 1000


def test_fewer_processes_accumulate_micro_batches_of_the_planned_size():
    """A run planned for W0 processes resumed on fewer: each share (W0 / W planned batches' samples) is cut into
    micro-batches no bigger than a planned one - at most batch_size samples, or within the token budget (or one
    sample) - which hold exactly the share, in order. Before, the whole share was one batch: W0 / W times the
    memory the run was sized for (out of memory on a card the run just fitted)."""
    checked = 0
    for n, canonical, seed in itertools.product(SIZES + [200], WORLDS, [0, 1]):
        if n < canonical:
            continue
        for sampler in samplers(n, canonical, seed):
            for world in (w for w in WORLDS if w < canonical):
                steps = elastic.on_world(sampler, world)
                split = elastic.micro_split(steps)
                for shares in steps.global_steps(seed):
                    for share in shares:
                        parts = split(share)
                        assert [i for p in parts for i in p] == share and all(parts) == bool(share)
                        for p in parts:
                            if hasattr(sampler, "max_tokens"):
                                assert len(p) == 1 or _cost(p, sampler.lengths) <= sampler.max_tokens
                            else:
                                assert len(p) <= sampler.batch_size
                        checked += 1
    assert checked > 1000
    same = LengthAwareBatchSampler(random_lengths(8, 0), 2, 0, world_size=2)
    assert elastic.micro_split(elastic.on_world(same, 2))([3, 1, 2, 0]) == [[3, 1, 2, 0]]  # no change: as planned


def test_the_epoch_padding_after_a_shrink_counts_the_micro_batches_that_run():
    """A run planned for 2 processes (batch 2) resumed on 1: each step's share (4 samples, sorted by length) runs
    as 2 micro-batches of 2, each padded to its own longest. The epoch's padding_efficiency (and each logged
    step's) counted the share as one batch of 4 padded to the longest of all 4: a forward no process ran, and a
    lower figure than the one computed (here 0.85 against 0.97, the straight 2-process run's too)."""
    from types import SimpleNamespace

    from stages.train.prefetch import MicroBatches
    from stages.train.recipe import _count_epoch_tokens
    from stages.train.sampler import padded_tokens, padding_efficiency

    lengths = random_lengths(24, 0)
    steps = elastic.on_world(LengthAwareBatchSampler(lengths, 2, 0, world_size=2), 1)
    batches = MicroBatches(DataStream(steps), SimpleNamespace(on_damaged="stop"),
                           SimpleNamespace(check_ahead=0, grad_accum=1), 0, 0, torch.device("cpu"), torch.float32)
    r = SimpleNamespace(tables=SimpleNamespace(lengths=lengths), epoch_tokens=[0, 0], writer=None, batches=batches,
                        result=SimpleNamespace(epoch_padding={}), step_running_tokens=[0, 0])
    plan = list(steps.global_steps(0))
    for k, shares in enumerate(plan):
        _count_epoch_tokens(r, SimpleNamespace(epoch=0, global_batch=shares, ends_epoch=k == len(plan) - 1))
    [share] = plan[0]
    assert len(share) == 4 and batches.as_run(plan[0]) == [share[:2], share[2:]]  # the planned size, as run
    as_run = [part for shares in plan for share in shares for part in (share[:2], share[2:])]
    want, _ = padding_efficiency(as_run, lengths)
    one_batch, _ = padding_efficiency([share for shares in plan for share in shares], lengths)
    assert r.result.epoch_padding[0] == pytest.approx(want, rel=1e-12)
    assert r.step_running_tokens == list(padded_tokens(as_run, lengths))  # the steps' figure: the same micro-batches
    assert want - one_batch > 0.05, (want, one_batch)  # the figure counted before


def test_a_share_in_micro_batches_gives_the_gradient_of_one_batch(tiny_edit_model, tmp_path):
    """The share of a run planned for 2 processes (batch 2 each) resumed on 1: 4 samples as 2 micro-batches of 2
    give the loss and LoRA gradient of the 4 in one batch (the padded batches equal batch-1 runs)."""
    from stages.train.prefetch import prepare, prepare_chunks
    from stages.train.recipe import backward_of

    tc, tables, transformer, params = _trainable(tiny_edit_model, tmp_path, 4)
    cpu = torch.device("cpu")
    share = [0, 1, 2, 3]
    one = backward_of(transformer, prepare(tables, tc, share, 3, cpu, torch.float32), tc, cpu, scale=0.25)
    whole = [p.grad.clone() for p in params]
    transformer.zero_grad(set_to_none=False)
    flows = prepare_chunks(tables, tc, share, [share], 3, cpu, torch.float32, None,
                           lambda s: elastic.chunks(s, None, batch_size=2))
    assert [len(f.targets) for f in flows] == [2, 2]
    parts = torch.cat([backward_of(transformer, f, tc, cpu, scale=0.25) for f in flows])
    torch.testing.assert_close(parts, one, rtol=1e-5, atol=1e-6)
    for got, want in zip((p.grad for p in params), whole):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    transformer.zero_grad(set_to_none=False)

    # the trainer's own micro-batches: a plan for 2 processes (batch 2 each) read by 1 comes as 2 parts of 2
    from stages.train.prefetch import MicroBatches

    planned = LengthAwareBatchSampler([100, 200, 300, 400], 2, 0, world_size=2)
    batches = MicroBatches(DataStream(elastic.on_world(planned, 1)), tables, tc, 0, 0, cpu, torch.float32)
    try:
        m = batches.next()
    finally:
        batches.close()
    assert [len(f.targets) for f in m.flows] == [2, 2] and sorted(m.global_batch[0]) == share
