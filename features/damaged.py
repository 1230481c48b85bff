"""`on_damaged: skip` while reading, with no pass over the split before the first read: a sample is CRC-checked
on its first read (store/sample_check.py, as every read), and one found damaged is left out where it is met.
The limit `max_damaged_fraction` is judged on what was read so far (`over_limit`); train applies it at every
optimizer step on counts summed over the ranks (stages/train/damaged.py), evaluate and the validator here
(`read_intact`: the validator's ranks each read the same samples and agree on the damaged ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, ContextManager, Protocol, TypeVar

from schemas.errors import UserError
from store.integrity import DamagedData
from store.join import JoinedTables

T = TypeVar("T")


def over_limit(damaged: int, read: int, total: int, fraction: float) -> bool:
    """More than `fraction` damaged, of max(samples read, samples in the split). Counts are occurrences (a sample
    read in two epochs counts twice, damaged or not). Over the split's size while fewer were read: the limit is
    reached only once it is certain for the whole split (a ratio over the first few reads would stop a run whose
    first sample read is damaged: 1 of 1 > 1%); at an epoch's end it is exactly the old full check's verdict."""
    return damaged > fraction * max(read, total)


def limit_message(damaged: int, read: int, total: int, fraction: float, section: str, split: str | None,
                  store: Path | str, listed: str) -> str:
    """The one line every rank prints when `over_limit` (the same numbers on every rank: no rank's own keys)."""
    return (f"{damaged} of the {read} '{split}' samples read so far in {store} are damaged ({section}.on_damaged="
            f"skip), more than {section}.max_damaged_fraction = {fraction} of {max(read, total)} (the split holds "
            f"{total}); listed in {listed}; run `pipeline store repair {store}`, or raise "
            f"{section}.max_damaged_fraction to use the rest")


def check_some_intact(kept: int, tables: JoinedTables, otherwise: str = "") -> None:
    """Every sample read damaged and left out (on_damaged=skip; max_damaged_fraction 1.0 lets it pass the limit):
    refused, one line, where a figure over 0 samples was a mean of nothing (the validator divided by 0 after the
    steps before it; evaluate wrote a NaN loss, `--all-checkpoints` blamed the run's training loss)."""
    if kept == 0 and tables.damaged:
        raise UserError(f"every '{tables.split}' sample read in {tables.store_root} is damaged ({len(tables.damaged)}"
                        f" left out, {tables.section}.on_damaged=skip): no held-out loss to measure over 0 samples; "
                        f"run `pipeline store repair {tables.store_root}`{otherwise}")


class Agreement(Protocol):
    """How the ranks that each read the same samples agree on the damaged ones (stages pass their collectives)."""

    def reading(self) -> ContextManager[None]: ...  # one round's reads: an error on one rank stops every rank
    def any(self, flags: list[int]) -> list[int]: ...  # each flag's maximum over the ranks


def rows_read(tables: JoinedTables, n: int | None) -> int | None:
    """How many of the join's first rows `read_intact(tables, n)` reads: the first `n` and one more for each damaged
    sample left out so far (on_damaged=skip, in row order: `tables.damaged`); None where that is every row (`n`
    None, or not below the join's size). What a record of the samples read is keyed by (`content_names(first)`:
    evaluate's loss arrays and caches, train's validation curve): a sample after these rows is never read."""
    if not n or n >= len(tables):
        return None
    return min(len(tables), n + len(tables.damaged))


def read_intact(tables: JoinedTables, n: int, load: Callable[[int], T], desc: str = "read samples",
                agreement: Agreement | None = None, otherwise: str = "") -> list[T]:
    """The first `n` intact samples of the join in row order (`load(row)` each). With the tables opened
    on_damaged=skip, a damaged one is left out, recorded in `tables.damaged` (key -> problem), and the next row
    read instead (so the n are those a split without the damaged samples would give); then `over_limit`
    -> UserError. With "stop" the first damaged sample raises `DamagedData`.

    `agreement`: ranks that each read all n and combine what they compute (the train validator's grid). A sample
    one rank finds damaged (its node's copy of a shard) is left out on every rank, round by round, so every rank
    holds the same list; before, that rank read the next row instead and the summed grid mixed two samples'
    losses under one key. Every one read damaged: `check_some_intact` (`otherwise`: the caller's other remedy)."""
    from contextlib import nullcontext

    from tqdm.auto import tqdm

    loaded: dict[int, T] = {}
    kept: list[int] = []
    tried = 0
    with tqdm(total=n, desc=desc, unit="sample", leave=False) as bar:
        while len(kept) < n and tried < len(tables):
            candidates = range(tried, min(len(tables), tried + n - len(kept)))
            bad = [0] * len(candidates)
            with agreement.reading() if agreement is not None else nullcontext():
                for j, i in enumerate(candidates):
                    try:
                        loaded[i] = load(i)
                    except DamagedData as e:
                        if tables.on_damaged != "skip":
                            raise
                        tables.damaged[tables.keys[i]] = " ".join(str(e).splitlines())
                        bad[j] = 1
            if agreement is not None:
                bad = agreement.any(bad)
            for i, b in zip(candidates, bad):
                if b:
                    loaded.pop(i, None)
                    tables.damaged.setdefault(tables.keys[i], "damaged on another rank (its output names the problem)")
                else:
                    kept.append(i)
            bar.update(len(candidates) - sum(bad))
            tried = candidates[-1] + 1
    damaged = len(tables.damaged)
    if damaged and over_limit(damaged, tried, len(tables), tables.max_damaged_fraction):
        keys = sorted(tables.damaged)
        listed = ", ".join(keys[:5]) + (f" ... ({damaged} in all)" if damaged > 5 else "")
        raise UserError(limit_message(damaged, tried, len(tables), tables.max_damaged_fraction, tables.section,
                                      tables.split, tables.store_root, listed))
    check_some_intact(len(kept), tables, otherwise)
    return [loaded[i] for i in kept]
