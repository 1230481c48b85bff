"""`train.on_damaged: skip` in the step loop, with no pass over the split before step 0.

The sampler plans every joined sample, damaged or not (nothing is known before the reads). Each sample is
CRC-checked on its first read, as always; one found damaged is left out of its batch where it is met
(`DamagedRows.load`), recorded in the store by the reader and in RUN/damaged_samples.jsonl by the rank that met
it (`record`), and never read again by that rank. A rank whose whole share of a micro-batch is damaged runs a
zero-weight stand-in (an intact sample: DDP's all-reduce needs every rank's backward).

The step is then the mean loss over the samples it really trained on: each rank's damaged count rides on the
step's loss all-reduce (one more number), and the gradients DDP averaged with the planned count are scaled by
planned / intact (one multiply; exactly 1.0 when nothing was damaged, so such a step is bit-identical). Not a
duplicate of another sample in the hole: that would weigh one sample twice. What differs from a store without
those samples: the plan (batches, steps per epoch) was made with them, so their batches are one sample short.

`max_damaged_fraction` is judged at every step on the counts summed over the ranks (`features.damaged.over_limit`),
so every rank stops at the same step with the same line."""

from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import Iterable

from tqdm.auto import tqdm

from features.damaged import limit_message, over_limit
from models.sample import TrainSample
from schemas.errors import UserError
from stages.train import guard
from stages.train.data import load_at
from store.integrity import DamagedData
from store.join import JoinedTables


class DamagedRows:
    """This rank's damaged rows (joined index -> problem): met once, then left out of every later batch unread.
    Used by the one thread that prepares micro-batches."""

    def __init__(self, skip: bool) -> None:
        self.skip = skip
        self.known: dict[int, str] = {}

    def read(self, tables: JoinedTables, i: int) -> TrainSample | None:
        """Sample i, or None when it is damaged and damaged samples are skipped (else `DamagedData` raises)."""
        if i in self.known:
            return None
        try:
            return load_at(tables, i)
        except DamagedData as e:
            if not self.skip:
                raise
            self.known[i] = " ".join(str(e).splitlines())
            return None

    def load(self, tables: JoinedTables, indices: list[int]) -> list[TrainSample]:
        """The intact samples of `indices`, in order."""
        return [s for s in (self.read(tables, i) for i in indices) if s is not None]

    def stand_in(self, tables: JoinedTables, first: Iterable[int]) -> TrainSample:
        """An intact sample for a zero-weight stand-in: the first of `first` (the step's samples), else of the
        split. Reads only until one is intact."""
        for i in chain(first, range(len(tables))):
            s = self.read(tables, i)
            if s is not None:
                return s
        raise UserError(f"every '{tables.split}' sample in {tables.store_root} is damaged; run "
                        f"`pipeline store repair {tables.store_root}`")

    def damaged_of(self, indices: list[int]) -> dict[int, str]:
        return {i: self.known[i] for i in indices if i in self.known}


class DamageTally:
    """The run's counts (summed over the ranks at every step; a resume starts from its checkpoint's) and what
    this rank has written to RUN/damaged_samples.jsonl."""

    def __init__(self, run_dir: Path, rank: int, world: int, rerun: str = "rerun with --resume") -> None:
        self.run_dir, self.rank, self.world, self.rerun = run_dir, rank, world, rerun
        self.read = self.damaged = 0
        from stages.train import damaged_log

        self._listed = set(damaged_log.read(run_dir))  # a resume lists again none of the earlier starts' samples
        self._read_to = 0  # the list's bytes this rank has read for what the other ranks listed

    def record(self, tables: JoinedTables, found: dict[int, str], step: int) -> None:
        """This rank's damaged rows of a micro-batch: the new ones into the run's list and named in one line. New
        to the run, not to this rank: a sample another rank met in an earlier epoch is listed (and named) once."""
        from stages.train import damaged_log

        others, self._read_to = damaged_log.listed_since(self.run_dir, self._read_to)
        self._listed |= others
        new = {k: p for k, p in ((tables.keys[i], p) for i, p in found.items()) if k not in self._listed}
        if not new:
            return
        self._listed |= set(new)
        path = guard.record_skipped(self.run_dir, new, self.rerun, step)
        who = f"rank {self.rank}: " if self.world > 1 else ""
        tqdm.write(f"{who}optimizer step {step}: left out damaged sample(s) {', '.join(sorted(new))} "
                   f"(train.on_damaged=skip; listed in {path})")

    def add(self, tables: JoinedTables, damaged: int, read: int) -> None:
        """A step's counts (every rank's); over `train.max_damaged_fraction` -> the same error on every rank."""
        self.damaged += damaged
        self.read += read
        f = tables.max_damaged_fraction
        if damaged and over_limit(self.damaged, self.read, len(tables), f):
            from models.collective import RankFailed

            # agreed: every rank has these numbers from the same all-reduce, and raises this same line
            raise RankFailed(limit_message(self.damaged, self.read, len(tables), f, "train", tables.split,
                                           tables.store_root, str(self.run_dir / guard.DAMAGED_REPORT)))


def tables_skip(tables: JoinedTables) -> bool:
    """Whether this join was opened with on_damaged=skip (damaged samples left out where they are read)."""
    return tables.on_damaged == "skip"
