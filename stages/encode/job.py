"""`EncodeJob`: what one encode run holds (store, `images` reader and lease, lineage, ranks, writer, summary) and
the calls a stage makes on it, top to bottom. The work is in the modules named by what they do: `plan`
(`open_job`: lineage, up to date?), `output` (open the writer, carry forward), `intake` (read checked,
quarantine), `commit` (finish, close), `batching` (prefetch, shape-grouped batches)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar

import torch

from schemas.errors import Rejected
from schemas.lineage import Lineage
from schemas.table import TableSchema
from store import Store, TableReader, TableWriter
from stages.encode import commit, intake, output
from stages.encode.batching import TooLargeAlone
from stages.encode.ranks import Ranks
from stages.encode.summary import Summary

if TYPE_CHECKING:
    from collections.abc import Sequence

    from stages.encode.batching import MemoryBoundForward
    from stages.encode.progress import SampleProgress

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class EncodeJob:
    store: Store
    images: TableReader
    images_id: str  # the `images` version's identity (`Store.version_id`): what every rank must read alike
    lineage: Lineage
    ranks: Ranks
    summary: Summary
    started: float = field(default_factory=time.perf_counter)
    loop_started: float = 0.0
    writer: TableWriter | None = None
    feature_lineage: str = ""  # see store.reuse: samples with this lineage in earlier versions are carried
    earlier_lineages: tuple[str, ...] = ()  # the same features hashed as before the declared scheme: carried too
    serving: tuple[Lineage, ...] = ()  # lineages of settings that only add columns: their complete versions serve
    # lineage from before a fix (in earlier_lineages) -> "does a fix change this stored row?" (stages/encode/plan.py)
    changed_by_fixes: dict[str, Any] = field(default_factory=dict)
    match_columns: tuple[str, ...] = ()  # images columns a carried row must still match (vae: mask_sha256)
    # a key not carried is carried from an earlier row of the same pictures under another key (vae: a recaption)
    same_inputs_carry: bool = False
    # a key whose mask alone changed keeps its stored latents, its mask weights computed now (vae: mask_only.py)
    mask_only_carry: bool = False
    # feature lineages of samples holding part of this run's columns (encode-text: encoded without
    # no_control_embeds), and how the stage completes such rows: (version, its stored rows) -> the keys it wrote,
    # each with its stored part and the missing one computed now (stages/encode/output.py `_completed`)
    partial_lineages: tuple[str, ...] = ()
    # of those, what the version's schema records (`attrs.part_lineages`): the one of the settings as hashed now, so
    # the schema depends on the settings and inputs alone (`plan.JobLineages.part_record`)
    part_record: tuple[str, ...] = ()
    complete_rows: Callable[[int, Any], set[str]] | None = None
    # encode-text: (stored length, img_shapes now) -> does the prompt fit next to the images now? Set, a
    # carried row takes the images' img_shapes now (its encoder does not read the target: a new target size
    # carries it), and one whose img_shapes changed is carried only if it still fits (else it is read again and
    # rejected as a fresh encode rejects it; stages/encode/output.py `_shapes_now`)
    prompt_fits: Callable[[int, list], bool] | None = None
    # the model's rule on a sample's control count (intake.read_inputs): a sample it refuses is never carried either
    by_controls: Callable[[int, str], Rejected | None] | None = None
    control_census: Any = None  # the `images` distinct control counts and their samples (intake.control_census)
    lease: Any = None  # the read lease on `images` (store/lease.py); released when the job is done or collected
    on_damaged: str = "stop"  # a damaged `images` sample: stop, or skip (quarantined as DAMAGED_INPUT)
    settings: dict[str, Any] = field(default_factory=dict)  # `settings.settings_record`: hashed, and recorded
    model_files: tuple = ()  # the model's files (schemas/model_files.py): recorded, named when a later model differs
    max_damaged_fraction: float = 0.0  # on_damaged=skip: stop anyway above this share of this rank's samples
    repairing: int | None = None  # the current version, recorded as damaged: verify the new one after commit
    total: int = 0  # this rank's share of the `images` keys (the damaged-input threshold's base)
    quarantine_rows: list[dict[str, Any]] = field(default_factory=list)
    shard_sizes_before: dict[str, int] = field(default_factory=dict)

    @property
    def up_to_date(self) -> bool:
        return self.summary.up_to_date

    # ------------------------------------------------------------ output (stages/encode/output.py)

    def open_writer(self, schema: TableSchema, shard_size_mb: float) -> intake.Todo:
        """Open (or resume) the output version, carry forward every key an earlier version with the same feature
        lineage holds (hard-linked shards, split relabelled from `images`); return this rank's keys left to do."""
        return output.open_writer(self, schema, shard_size_mb)

    # ------------------------------------------------------------ input (stages/encode/intake.py)

    def read_inputs(self, keys: Sequence[str], by_controls: Callable[[int, str], Rejected | None] | None = None
                    ) -> Iterator[tuple[str, dict[str, Any] | Rejected]]:
        """(key, `images` sample) in order, each checked; a damaged one as a `Rejected` under on_damaged=skip; one
        `by_controls` refuses for its control count as its `Rejected`, its files unread."""
        return intake.read_inputs(self, keys, by_controls)

    unless_rejected = staticmethod(intake.unless_rejected)

    def quarantine(self, key: str, reason: str, detail: str = "") -> None:
        """Reject one sample (it stays out of the table); the rows land in quarantine.parquet at `finish`."""
        intake.quarantine(self, key, reason, detail)

    def accepted(self, prepared: Iterable[T | Rejected], bar: "SampleProgress") -> Iterator[T]:
        """Pass prepared samples through; quarantine the rejected ones (they count as done on the bar)."""
        return intake.accepted(self, prepared, bar)

    # ------------------------------------------------------------ the loop

    def progress(self, total: int) -> "SampleProgress":
        """Samples/s is tqdm's rate; one bar per rank (stages/encode/progress.py)."""
        from stages.encode.progress import SampleProgress

        r = self.ranks
        desc = self.summary.stage + (f" r{r.rank}" if r.world_size > 1 else "")
        return SampleProgress(total, desc, position=r.rank)

    @contextmanager
    def timed_forward(self, items: int, forward: MemoryBoundForward | None = None) -> Iterator[None]:
        """Time spent in the model (a GPU is synchronised so its queued work counts here, not after). `forward`: the
        one the block calls once; each part it ran counts as a forward (a batch halved after an out-of-memory ran
        as two or more), else the block is one."""
        t0 = time.perf_counter()
        yield
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.summary.forward_seconds += time.perf_counter() - t0
        self.summary.forwards += 1 if forward is None else forward.ran
        self.summary.forward_items += items

    # ------------------------------------------------------------ the end (stages/encode/commit.py)

    def finish(self) -> Summary:
        """Quarantine rows, this rank's last shard, rank 0 commits (manifest last); all ranks agree on both."""
        return commit.finish(self)

    def close(self) -> None:
        """Give up without committing (on error; a rerun resumes); close the `images` reader, release the lease."""
        commit.close(self)

    def failed(self, error: BaseException) -> None:
        """This rank failed in its loop: the other ranks learn it at their next agreement (`finish`)."""
        commit.failed(self, error)

    @contextmanager
    def working(self) -> Iterator[None]:
        """A stage's work from the model load on: a failure there is told to the other ranks (`failed`: they stop
        with its line, not at the commit), and the job is closed however it ends (a load that fails closes its
        images reader and its lease too)."""
        try:
            yield
        except TooLargeAlone as e:
            self.failed(e)  # first: the other ranks stop whatever keeping the shard meets (a full disk)
            # a killed run's resume keeps every committed shard: this stop keeps the open one's finished samples too
            if self.writer is not None:
                self.writer.keep_open_shard()
            raise
        except BaseException as e:
            self.failed(e)
            raise
        finally:
            self.close()
