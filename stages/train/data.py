"""The trainer's data: the joined `text` + `vae` inputs of one split, one sample, and the data position.

The join itself (same keys in both tables, built with this model, lengths from the manifests) is
`features.open.open_features`; the sample check is `models.sample.from_features`; per-sample σ, noise and caption
dropout are `models.randomness`. What is left here is the trainer's endless (epoch, batch) stream.
"""

from __future__ import annotations

import threading
from pathlib import Path

from features.open import open_features
from models.sample import TrainSample, from_features
from schemas.units import count_text
from stages.train.epoch_plan import EpochPlan
from stages.train.sampler import LengthAwareBatchSampler
from store.join import JoinedTables


def open_inputs(store: str | Path, model: str, split: str = "train", max_dropped_fraction: float = 0.05,
                max_open_shards: int = 256, on_damaged: str = "stop",
                max_damaged_fraction: float = 0.0) -> JoinedTables:
    """With on_damaged=skip nothing is read here: the trainer leaves a damaged sample out of its batch where it
    meets it (stages/train/damaged.py)."""
    from models.loading import model_files
    from schemas.model_files import fingerprint_of

    files = model_files(model)
    return open_features(store, model, fingerprint_of(files), split, max_dropped_fraction, max_open_shards,
                         on_damaged=on_damaged, max_damaged_fraction=max_damaged_fraction, model_files=files)


def load(tables: JoinedTables, key: str) -> TrainSample:
    return from_features(key, *tables.features(key))


def load_at(tables: JoinedTables, i: int) -> TrainSample:
    """The i-th joined sample, addressed by row numbers (no key lookups: the trainer's path at any scale)."""
    return from_features(*tables.features_at(i))


def write_data_report(run_dir: Path, tables: JoinedTables) -> str:
    """RUN/data.json: what the join kept and dropped (and why); returns the one line the trainer prints."""
    from store.format import atomic_write_json

    rep = tables.report
    atomic_write_json(Path(run_dir) / "data.json", rep)
    if not rep.get("dropped"):
        return (f"training on all {count_text(rep.get('joined', len(tables)), 'sample')} of the "
                f"'{rep.get('split')}' split")
    reasons = "; ".join(f"{st}: " + ", ".join(f"{r} {n}" for r, n in sorted(rs.items()))
                        for st, rs in sorted(rep["reasons"].items()))
    return (f"training on {rep['joined']} of {count_text(rep['samples'], 'sample')} of the '{rep['split']}' split: "
            f"{rep['dropped']} "
            f"not in both the text and vae tables ({reasons}; rows in {rep['quarantine_file']})")


class DataStream:
    """Endless (epoch, batch) stream over the sampler; `position` is what a checkpoint stores."""

    # Epoch plans kept: the one being read and the next, which the check-ahead walkers reach first.
    KEPT_PLANS = 2

    def __init__(self, sampler: LengthAwareBatchSampler, epoch: int = 0, batch: int = 0):
        self.sampler, self.epoch, self.batch = sampler, epoch, batch
        self._steps: EpochPlan | None = None  # the epoch being read
        self._plans: dict[int, EpochPlan] = {}
        self._lock = threading.Lock()

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.batch

    def steps(self, epoch: int) -> EpochPlan:
        """Every rank's batches of `epoch`, planned once for the stream and the check-ahead threads walking it
        (`stages.train.prefetch.read_order`): at 1M samples a plan takes ~0.2-1 s (arrays of ~6-7 MB,
        `stages.train.epoch_plan`), and each table's walker used to plan it again."""
        with self._lock:  # the trainer (or its prefetch thread) and one walker per table ask at once
            plan = self._plans.get(epoch)
            if plan is None:
                plan = self._plans[epoch] = self.sampler.global_steps(epoch)
                for old in sorted(e for e in self._plans if e != epoch)[: len(self._plans) - self.KEPT_PLANS]:
                    del self._plans[old]  # the oldest; whoever walks it holds its own reference
            return plan

    def planned_samples(self, position: tuple[int, int], micro_steps: int) -> int:
        """Every rank's samples of the `micro_steps` global micro-batches from `position` on, from the plans alone:
        what an optimizer step's loss is scaled by (world_size / samples in the step) before any of its
        micro-batches is read, so each can be read, run and dropped in turn (`recipe._accumulate`)."""
        epoch, batch = position
        n = 0
        for _ in range(micro_steps):
            steps = self.steps(epoch)
            planned = getattr(steps, "planned", steps)  # a re-split step (elastic.py) holds its planned samples
            n += sum(len(b) for b in planned[batch])
            epoch, batch = (epoch + 1, 0) if batch + 1 == len(steps) else (epoch, batch + 1)
        return n

    def next(self) -> tuple[int, list[list[int]], bool]:
        """(epoch, every rank's batch of the next global micro-step, whether it ends the epoch)."""
        if self._steps is None:  # held for the epoch: walkers far ahead (tiny epochs) may drop it from `_plans`
            self._steps = self.steps(self.epoch)
        epoch, step = self.epoch, self._steps[self.batch]
        self.batch += 1
        last = self.batch == len(self._steps)
        if last:
            self.epoch, self.batch, self._steps = self.epoch + 1, 0, None
        return epoch, step, last
