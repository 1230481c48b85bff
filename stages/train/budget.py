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
4. the leftover batches (fewer than ranks) are the last step, split, largest first, into halves until there is
   one per rank: every half of a batch within budget is within budget. When the leftovers hold fewer samples than
   there are ranks, the ranks left over get an empty batch (the trainer runs a zero-weight stand-in there,
   `stages/train/prefetch.py::prepare_share`, as after an elastic resume on more ranks) - every index appears
   exactly once per epoch, every batch is within the budget and every rank gets the same number of batches (DDP
   steps in lockstep). Runs planned before (`NUMPY_SHUFFLE`, `PYTHON_SHUFFLE`) had those few samples join the
   last full step, one per batch, and go on so: a budget-long sample joining a batch of short ones took it far
   over the budget (17 x 1000-token samples padded to 16000 on a budget of 16384: an out-of-memory at an
   epoch's end that `pipeline plan`, which plans a micro-batch at the budget, did not foresee).
A sample longer than the budget is an error: the budget must hold the longest sample.

The two shuffles (steps 1 and 3) draw from (seed, epoch) by the run's `shuffle` (recorded in its checkpoints,
`ResumeRecord.plan_shuffle`): `TAIL_IN_BUDGET` for runs started now (step 4 above) and `NUMPY_SHUFFLE`, numpy
permutations seeded from `store.partition.rng_for` as the length-aware sampler's; `PYTHON_SHUFFLE` for runs started
before it (Python's random.shuffle, ~0.7 s a plan at 1M samples, every epoch and rank), so their resumes continue
their own order.
"""

from __future__ import annotations

from array import array

import numpy as np

from stages.train.epoch_plan import EpochPlan
from store.partition import rng_for

# How a plan's shuffles draw from (seed, epoch), and where its leftovers go: recorded per run, never changed for a
# run (its resumes must see its order); a fresh run takes `PLAN_SHUFFLE`. `TAIL_IN_BUDGET`: numpy's shuffles, and
# leftovers of fewer samples than ranks are a step of their own (`global_steps`, step 4), never joined to a full
# step's batches, which took those over the budget (a budget-long sample added to a batch of 16 short ones: 17x).
PYTHON_SHUFFLE, NUMPY_SHUFFLE, TAIL_IN_BUDGET = 1, 2, 3
PLAN_SHUFFLE = TAIL_IN_BUDGET


def _shuffler(seed: int, epoch: int, shuffle: int):
    """`shuffled(n)`: a permutation of range(n) as int64 numbers; successive calls continue one generator."""
    rng = rng_for(seed, epoch)
    if shuffle in (NUMPY_SHUFFLE, TAIL_IN_BUDGET):
        gen = np.random.default_rng(rng.getrandbits(64))
        return lambda n: gen.permutation(n)
    if shuffle != PYTHON_SHUFFLE:
        raise ValueError(f"plan shuffle {shuffle}: this code knows {PYTHON_SHUFFLE} to {TAIL_IN_BUDGET}")

    def shuffled(n: int) -> np.ndarray:
        # an array, not a list, shuffled by the same draws (random.shuffle swaps items of any sequence): 8 B a
        # sample instead of a list's 8 B + a 28 B int each (~36 MB at a million samples)
        order = array("q", range(n))
        rng.shuffle(order)
        return np.frombuffer(order, dtype=np.int64) if n else np.zeros(0, np.int64)

    return shuffled


class TokenBudgetBatchSampler:
    """Every rank's batches of an epoch under a computed-token budget, deterministic from (seed, epoch)."""

    def __init__(self, lengths: list[int], max_tokens: int, seed: int, window: int = 64, world_size: int = 1,
                 shuffle: int = PLAN_SHUFFLE):
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
        self.shuffle = shuffle
        _shuffler(seed, 0, shuffle)  # an unknown shuffle refused here, not at the first plan
        mean = int(self.lengths.sum()) / len(self.lengths) if len(self.lengths) else 1
        # A window of `window` global steps, in samples: mean batch size estimated from the mean length.
        self.window_samples = window * world_size * max(1, int(max_tokens // mean))

    def _batches(self, order: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Greedy fill of each sorted window: (the windows' samples sorted by length, back to back; each
        batch's size in that order)."""
        # Stable sort within each window: equal lengths keep their shuffled order, so ties are mixed too.
        window_of = np.arange(len(order)) // self.window_samples
        flat = order[np.lexsort((self.lengths[order], window_of))]
        del window_of
        sizes: list[int] = []
        # Python ints for the per-sample loop (numpy scalar reads took half the plan), one window at a time: a
        # list of the whole epoch's lengths held ~36 MB at a million samples. A window starts a new batch.
        for start in range(0, len(flat), self.window_samples):
            size = 0
            for length in self.lengths[flat[start:start + self.window_samples]].tolist():
                if size and (size + 1) * length > self.max_tokens:
                    sizes.append(size)
                    size = 0
                size += 1
            sizes.append(size)
        return flat, sizes

    def global_steps(self, epoch: int) -> EpochPlan:
        """All ranks' batches: steps[k][r] is rank r's k-th batch of the epoch (arrays, `EpochPlan`: the nested
        lists of a 1M-sample plan held ~74 MB in every rank)."""
        shuffled = _shuffler(self.seed, epoch, self.shuffle)
        flat, sizes = self._batches(shuffled(len(self.lengths)))
        w = self.world_size
        n_full = len(sizes) // w
        # The steps' order: shuffling step numbers draws what shuffling the steps themselves did.
        perm = shuffled(n_full).tolist()
        starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        tail = [flat[starts[j]:starts[j + 1]].tolist() for j in range(n_full * w, len(sizes))]
        last: list[list[int]] = []
        if tail and sum(len(b) for b in tail) < w and self.shuffle != TAIL_IN_BUDGET:
            # runs planned before TAIL_IN_BUDGET: fewer samples than ranks, one each joins the last full step
            last = [flat[starts[j]:starts[j + 1]].tolist() for j in range(perm[-1] * w, perm[-1] * w + w)]
            for j, i in enumerate(i for b in tail for i in b):
                last[j] = last[j] + [i]
            perm, tail = perm[:-1], []
        elif tail:
            # halve the batch with the most samples (a half of a batch fits the budget) while a rank has none and
            # a batch has two; ranks still without one get an empty batch (a zero-weight stand-in in training)
            while len(tail) < w and max(len(b) for b in tail) > 1:
                big = max(range(len(tail)), key=lambda j: len(tail[j]))
                b = tail.pop(big)
                tail += [b[: len(b) // 2], b[len(b) // 2 :]]
            last = sorted(tail, key=lambda b: -len(b)) + [[] for _ in range(w - len(tail))]
        batch_ids = (np.asarray(perm, dtype=np.int64)[:, None] * w + np.arange(w)).reshape(-1)
        batch_sizes = np.asarray(sizes, dtype=np.int64)[batch_ids] if len(batch_ids) else np.zeros(0, np.int64)
        # gather the batches' samples in step order: position p of batch b reads flat[starts[b] + p]
        before = np.cumsum(batch_sizes) - batch_sizes
        picks = np.arange(int(batch_sizes.sum())) + np.repeat(starts[batch_ids] - before, batch_sizes)
        samples = np.concatenate([flat[picks], np.asarray([i for b in last for i in b], dtype=np.int64)])
        return EpochPlan(samples, np.concatenate([batch_sizes, [len(b) for b in last]]), w)


def computed_fill(steps: list[list[list[int]]], lengths: list[int], max_tokens: int) -> float:
    """Mean computed tokens (batch size x longest) / budget over all batches."""
    batches = [b for step in steps for b in step if b]
    if not batches:
        return 1.0
    return sum(len(b) * max(lengths[i] for i in b) for b in batches) / (len(batches) * max_tokens)


def refuse_over_budget(lengths, max_tokens: int, split: str, keys=None, when: str = "", then: str = "") -> None:
    """A UserError naming the `split` samples longer than `max_tokens` (the longest three by key, with their
    tokens; `keys` None: by length alone): such a sample runs alone and still over the budget, a forward
    `pipeline plan` (a micro-batch at the budget) did not plan. `when`: when it would run; `then`: what else the
    user may do."""
    from schemas.errors import UserError

    lengths = np.asarray(lengths, dtype=np.int64)
    over = np.flatnonzero(lengths > max_tokens)
    if not len(over):
        return
    over = over[np.argsort(-lengths[over], kind="stable")].tolist()
    named = ", ".join(f"{keys[i]} ({int(lengths[i])} tokens)" if keys is not None else f"{int(lengths[i])} tokens"
                      for i in over[:3])
    more = f" and {len(over) - 3} more" if len(over) > 3 else ""
    raise UserError(
        f"train.max_tokens_per_batch ({max_tokens}) is smaller than the longest {split} sample: {len(over)} "
        f"{split} sample(s) hold more tokens ({named}{more}), and one would run alone over the budget{when}; raise it "
        f"to at least {int(lengths[over[0]])}{then}"
    )


def make_sampler(lengths: list[int], batch_size: int, max_tokens: int | None, seed: int, window: int, world_size: int,
                 shuffle: int = PLAN_SHUFFLE, keys=None):
    """`train.max_tokens_per_batch` None: today's fixed `batch_size` batches; else token-budget batches, whose
    shuffles are the run's `shuffle` (the length-aware sampler has drawn by numpy from the first). `shuffle`
    `TAIL_IN_BUDGET` (runs started now): both samplers plan an epoch's leftovers of fewer samples than ranks as a
    step of their own, never into a full step's batches beyond the planned size or budget. `keys`: the samples'
    keys, to name those longer than the budget."""
    from schemas.errors import UserError
    from stages.train.sampler import LengthAwareBatchSampler

    if 0 < len(lengths) < world_size:  # the samplers' own ValueError reached a launched user as a traceback
        raise UserError(
            f"the training split holds {len(lengths)} sample(s), fewer than the {world_size} processes its steps are "
            f"planned for (every process trains on a sample of each step): launch at most {len(lengths)} "
            "process(es), or add training samples"
        )
    if shuffle not in (PYTHON_SHUFFLE, NUMPY_SHUFFLE, TAIL_IN_BUDGET):  # a checkpoint of a newer release's plan
        # (fixed batches too, since plan 3 places their short tail: an unknown plan would get the old join silently)
        raise UserError(
            f"the run's checkpoints record epoch plan {shuffle}, which this release does not know (it plans "
            f"{PYTHON_SHUFFLE} to {TAIL_IN_BUDGET}): a newer release started the run; finish it with that release, or "
            "train afresh (--new-run)"
        )
    if max_tokens is None:  # numpy's shuffles from the first; since plan 3 a short tail is a step of its own too
        return LengthAwareBatchSampler(lengths, batch_size, seed=seed, window=window, world_size=world_size,
                                       tail_apart=shuffle == TAIL_IN_BUDGET)
    refuse_over_budget(lengths, max_tokens, "training", keys)
    return TokenBudgetBatchSampler(lengths, max_tokens, seed=seed, window=window, world_size=world_size,
                                   shuffle=shuffle)
