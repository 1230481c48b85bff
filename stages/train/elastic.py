"""Elastic resume: the sample order of a run does not depend on how many processes train it.

MosaicML streaming's anchor is *canonical nodes*: the order is planned for a number of nodes fixed when the run
starts, and whatever physical nodes exist later take their share of that plan. Here the canonical number is the
run's first world size W0 (recorded in every checkpoint as `canonical_world_size`): the samplers
(`sampler.py`, `budget.py`) plan every epoch's global steps for W0 processes, exactly as before, and a start on
W processes splits each global step's samples over its W ranks (`split_step`). So:

- the samples of every global step - and therefore every optimizer step - are the same on any W: the loss is
  the mean per-sample loss of the step whatever the split (recipe.py's world_size / samples-in-step scaling),
  and per-sample σ / noise / dropout come from (seed, step, key), so a run resumed on another W trains the LoRA
  a straight run would (within float tolerance; bit-identical orders when W == W0);
- the data position (epoch, global step) of a checkpoint means the same on any W: after a change every remaining
  sample of the epoch is seen exactly once.
The global batch stays what the run started with (batch_size x W0 samples per micro-step); each process now
takes about W0 / W times as many (the one line printed on the change says so), as micro-batches no bigger than
planned (`chunks`: fewer processes accumulate more micro-batches; the memory per process stays what the run was
sized for). Token-budget steps are split by padded cost instead of count (`cost_shares`), so growing never gives
a process more than the budget. A step with fewer samples than
processes (the epoch's tail, after growing past W0) leaves some ranks an empty share: they run a stand-in of
zero weight, so DDP stays in lockstep and the step's gradient is still exactly the mean over its real samples -
unlike MosaicML's padding by repeated samples, no sample counts twice.

LoRA dropout draws from the global torch RNG, saved per rank: with the same W each rank restores its own; after a
change every rank seeds it from (seed, step, rank) instead (`restore_rng`), so a resume is still reproducible. A
fresh start on several ranks seeds it the same way at step 0 (`seed_rank_rng`): the LoRA is built from `seed` on
every rank, and left at that state every rank drew the same dropout masks.
LoRA dropout is not layout-independent in the first place (recipe.py), so with `lora.dropout` > 0 the LoRA after
a change matches no straight run exactly; with dropout 0 (the default) nothing reads that RNG.

Pure functions of integers, like the samplers (tested exhaustively in tests/stages/test_elastic.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from store.partition import rank_slice, rng_for


def split_step(step: list[list[int]], world_size: int, lengths: list[int], by_cost: bool = False) -> list[list[int]]:
    """A global step's samples (planned as any number of batches) as `world_size` batches: sorted by length
    (stable), so neighbours in length share a batch, then cut into contiguous shares within one of each other
    (`by_cost`: of the lowest possible padded cost instead, `cost_shares`). With fewer samples than processes
    some shares are empty: those ranks train on a zero-weight stand-in (`stages.train.prefetch.prepare_share`)."""
    samples = sorted((i for batch in step for i in batch), key=lengths.__getitem__)
    if by_cost:
        return cost_shares(samples, world_size, [int(lengths[i]) for i in samples])
    return [samples[slice(*rank_slice(len(samples), r, world_size))] for r in range(world_size)]


def _fit(sorted_lengths: list[int], start: int, cap: int) -> int:
    """How many samples from `start` one batch of padded cost (size x longest) <= cap holds (sorted ascending)."""
    end = start
    while end < len(sorted_lengths) and (end - start + 1) * sorted_lengths[end] <= cap:
        end += 1
    return end - start


def _shares_needed(sorted_lengths: list[int], start: int, cap: int) -> int:
    n, pos = 0, start
    while pos < len(sorted_lengths):
        pos, n = pos + _fit(sorted_lengths, pos, cap), n + 1
    return n


def cost_shares(samples: list[int], world_size: int, sorted_lengths: list[int]) -> list[list[int]]:
    """`samples` (sorted by length) cut into `world_size` contiguous shares whose largest padded cost (size x
    longest, the token budget's measure) is the lowest possible, counts as even as that cost allows.

    For token-budget steps: their batch sizes vary with length, so equal counts can give one rank the long
    samples *and* many of them (a step of 8 short + 2 long samples on 3 processes: 4 long ones' cost, 2 budgets).
    A contiguous cut of the sorted order is as good as any grouping for this cost, so the lowest cap is never
    above the planned batches' largest cost when the processes are at least as many as planned."""
    n = len(samples)
    if n == 0:
        return [[] for _ in range(world_size)]
    lo, hi = max(sorted_lengths), n * max(sorted_lengths)  # one share of the longest / everything in one share
    while lo < hi:  # the lowest cap that `world_size` shares can keep
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _shares_needed(sorted_lengths, 0, mid) <= world_size else (mid + 1, hi)
    shares, pos = [], 0
    for r in range(world_size):
        left = world_size - r
        most = _fit(sorted_lengths, pos, lo)
        take = min(most, -(-(n - pos) // left))  # even counts where the cap allows ...
        if _shares_needed(sorted_lengths, pos + take, lo) > left - 1:
            take = most  # ... else as many as the cap allows, so the rest still fits
        shares.append(samples[pos : pos + take])
        pos += take
    return shares


def chunks(share: list[int], lengths, batch_size: int | None = None, max_tokens: int | None = None) -> list[list[int]]:
    """A rank's share of a step (sorted by length: `split_step`) as contiguous micro-batches no bigger than the run
    planned per process: at most `batch_size` samples, or a padded cost (count x longest) within `max_tokens` (one
    sample at least, as the budget sampler's own batches). After a resume on fewer processes a share holds
    W0 / W planned batches' samples: one forward over all of them needs W0 / W times the memory the run was
    sized for; as micro-batches (gradients accumulated, DDP's all-reduce on the last) the peak stays the
    planned one and the gradient is the same sum. The empty share stays one (a stand-in)."""
    if not share:
        return [share]
    if max_tokens is None:
        size = max(1, int(batch_size or len(share)))
        return [share[i:i + size] for i in range(0, len(share), size)]
    sorted_lengths = [int(lengths[i]) for i in share]
    out, pos = [], 0
    while pos < len(share):
        take = max(1, _fit(sorted_lengths, pos, max_tokens))
        out.append(share[pos:pos + take])
        pos += take
    return out


def micro_split(steps):
    """`chunks` for the steps a start reads (`on_world`): shares of a re-split step, cut to the planned size; the
    canonical sampler's own batches as they are."""
    if not isinstance(steps, ElasticSteps):
        return lambda share: [share]
    planned = steps.sampler
    if steps.by_cost:
        return lambda share: chunks(share, steps.lengths, max_tokens=planned.max_tokens)
    return lambda share: chunks(share, steps.lengths, batch_size=planned.batch_size)


class SplitSteps(Sequence):
    """An epoch's planned steps, each split when it is read (a resume reads only those after its position)."""

    def __init__(self, planned: list[list[list[int]]], world_size: int, lengths: list[int], by_cost: bool = False):
        self.planned, self.world_size, self.lengths, self.by_cost = planned, world_size, lengths, by_cost

    def __len__(self) -> int:
        return len(self.planned)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [split_step(s, self.world_size, self.lengths, self.by_cost) for s in self.planned[k]]
        return split_step(self.planned[k], self.world_size, self.lengths, self.by_cost)


class ElasticSteps:
    """A sampler planned for `canonical` processes, its steps split over `world_size`: the same interface
    (`global_steps(epoch)`, `lengths`, `world_size`)."""

    def __init__(self, sampler, world_size: int):
        self.sampler = sampler
        self.lengths = sampler.lengths
        self.world_size = world_size
        self.canonical = sampler.world_size
        # token-budget steps (`budget.py`) are split by padded cost: their batches' sizes vary with length
        self.by_cost = hasattr(sampler, "max_tokens")

    def global_steps(self, epoch: int) -> SplitSteps:
        return SplitSteps(self.sampler.global_steps(epoch), self.world_size, self.lengths, self.by_cost)


def on_world(sampler, world_size: int):
    """The steps for this start: the canonical sampler itself when nothing changed, else its steps re-split."""
    return sampler if sampler.world_size == world_size else ElasticSteps(sampler, world_size)


def change_line(before: int, now: int, canonical: int, lora_dropout: float = 0.0) -> str:
    """The one line a resume on another process count prints. With LoRA dropout the masks come from each rank's
    torch RNG, seeded anew after the change (`restore_rng`): the same samples per step, not the same LoRA."""
    line = (f"world size changed {before} -> {now} processes: the sample order stays the one planned for "
            f"{canonical}; each global step's samples are now split over {now} ({canonical / now:.3g}x as many "
            "per process as at the start), so ")
    if lora_dropout > 0:
        return line + (f"every step holds the straight run's samples, but train.lora.dropout {lora_dropout}'s masks "
                       f"are drawn by {now} rank(s) seeded anew: the LoRA is not the one a straight run trains")
    return line + "the LoRA is the one a straight run trains"


def restore_rng(folder: Path, rank: int, same_world: bool, seed: int, step: int,
                kept: dict[str, bytes] | None = None, cuda: bool = False) -> None:
    """This rank's torch RNG: its own saved state on the same world size; after a change, seeded from
    (seed, step, rank) (the saved states belong to the old ranks). `cuda`: training on CUDA (`state.rng_states`)."""
    from stages.train import state as train_state

    if same_world:
        train_state.load_rng(folder, rank, cuda, kept)
        return
    seed_rank_rng(seed, step, rank)


def seed_rank_rng(seed: int, step: int, rank: int) -> None:
    """The global torch RNG (LoRA dropout's) of this rank from (seed, step, rank): a stream of its own. Also what a
    fresh start on several ranks begins with (stages/train/build.py), the LoRA having been built from `seed`
    alone, the same on every rank."""
    import torch

    torch.manual_seed(rng_for(seed, step, rank, 0x5EED).getrandbits(63))  # also seeds every CUDA device
