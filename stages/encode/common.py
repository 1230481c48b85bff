"""What the encode stages (encode-text, encode-vae) share: ranks, lineage, the up-to-date check, the resumable
writer with this rank's share of the `images` keys, quarantine, shape-grouped batching, prefetch, the summary.

A stage reads top to bottom as: `open_job` (lineage, up to date?) -> load its one model component ->
`job.open_writer(schema)` (keys still to do) -> loop over `batches_by_shape(prefetched(...))` -> `job.finish()`.
"""

from __future__ import annotations

import io
import os
import shutil
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Iterator, TypeVar

import torch
from PIL import Image

from schemas.config import Section
from schemas.errors import Rejected, UserError
from schemas.lineage import Lineage, code_version, feature_lineage, hashed_settings, settings_hash
from schemas.stage import few, summary_record
from schemas.table import TableSchema
from store import Store, TableReader, TableWriter, repair_context
from store.lease import hold
from store import format as fmt
from store.reuse import FEATURE_LINEAGE_ATTR, carry_forward, reusable

if TYPE_CHECKING:
    from stages.encode.progress import SampleProgress

T = TypeVar("T")
R = TypeVar("R")
S = TypeVar("S", bound=Section)

IMAGES_TABLE = "images"
DAMAGED_INPUT = "damaged-input"  # quarantine reason of an `images` sample whose bytes fail their checksum
# Device spellings a table hashed before the declared lineage scheme (which held `device`) may have been encoded
# with: with the one configured now, the old hashes tried so that those tables stay current and their samples reusable.
_EARLIER_DEVICES = ("cpu", "cuda", "mps", *(f"cuda:{i}" for i in range(8)))


# ---------------------------------------------------------------- processes


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    barrier: Callable[[], None] = lambda: None


def current_ranks(device: str | list[str]) -> Ranks:
    """This process's place under `accelerate launch` (or torchrun); a plain run is rank 0 of 1.

    Accelerate is only initialised when a launcher set WORLD_SIZE > 1, so a single process never touches
    torch.distributed. On a CPU device the process group is gloo (DESIGN §7: `Accelerator(cpu=True)`).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Ranks()
    from accelerate import PartialState

    from models.precision import first_device

    state = PartialState(cpu=str(first_device(device)).startswith("cpu"))
    return Ranks(state.process_index, state.num_processes, state.local_process_index, state.wait_for_everyone)


def rank_device(device: str | list[str], ranks: Ranks, what: str = "device") -> str:
    """`cuda` under a multi-process launch means this rank's own GPU; a list names one device per local rank."""
    from models.precision import device_for_rank

    return device_for_rank(device, ranks.local_rank, ranks.world_size, what)


def resolve_precision(section: S, device: str, stage: str) -> S:
    """The section with `dtype: auto` replaced by what it means on `device` (printed): the lineage hash and
    the table's recorded config then name the precision that produced the features."""
    from tqdm.auto import tqdm

    from models.precision import resolve_precision as resolve

    precision = resolve(section.dtype, device)
    tqdm.write(precision.describe(stage, device))
    return with_overrides(section, dtype=precision.weights)


# ---------------------------------------------------------------- lineage


def config_hash(section: Section, **extra: Any) -> str:
    """Fingerprint of the settings that determine features (declared in schemas/config.py, derived by
    schemas.lineage), plus whatever else the stage passes (e.g. the effective prompt template)."""
    return settings_hash({"section": hashed_settings(section), **extra})


def earlier_config_hashes(section: Section, **extra: Any) -> tuple[str, ...]:
    """`config_hash` as written before the declared scheme, when it also hashed `device`: the configured device
    first, then the usual spellings. Tables encoded then are still current, and their samples reused."""
    settings = hashed_settings(section)
    devices = [section.model_dump(mode="json")["device"], *_EARLIER_DEVICES]
    hashes = (settings_hash({"section": {**settings, "device": d}, **extra}) for d in devices)
    return tuple(dict.fromkeys(hashes))


def with_overrides(section: S, **overrides: Any) -> S:
    """The stage's config section with the CLI/keyword overrides that are not None, validated again."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return type(section).model_validate({**section.model_dump(), **given})


# ---------------------------------------------------------------- summary


@dataclass
class Summary:
    stage: str
    table: str
    version: int | None = None
    up_to_date: bool = False
    encoded: int = 0
    reused: int = 0  # carried forward from an earlier version with the same feature lineage (not recomputed)
    skipped: int = 0  # already in committed shards (resume) or the whole table when up to date
    quarantined: int = 0
    bytes_written: int = 0
    seconds: float = 0.0  # the whole run, model loading included
    loop_seconds: float = 0.0  # the encode loop: read, preprocess, forward, write
    forward_seconds: float = 0.0  # inside the model forward (bench: the rest of the loop is overhead)
    forwards: int = 0
    forward_items: int = 0  # prompts (text) or images (vae) through the model; / forwards = mean batch
    rank: int = 0
    world_size: int = 1
    store: str = ""
    damaged: dict[str, str] = field(default_factory=dict)  # on_damaged=skip: damaged `images` samples, key -> problem
    repaired_from: int | None = None  # the version recorded as damaged whose damaged samples this run recomputed

    def to_json(self) -> dict[str, Any]:
        # up to date: every sample of the table is reused as it is
        return summary_record(self.stage, self.table, self.version, self.encoded,
                              self.skipped if self.up_to_date else self.reused, self.quarantined, self.bytes_written,
                              self.seconds, self.up_to_date, resumed=0 if self.up_to_date else self.skipped,
                              rank=self.rank, world_size=self.world_size, damaged_inputs=sorted(self.damaged),
                              repaired_from=self.repaired_from)

    def __str__(self) -> str:
        where = f" [rank {self.rank}/{self.world_size}]" if self.world_size > 1 else ""
        if self.up_to_date:
            return (f"{self.stage}{where}: table '{self.table}' v{self.version} is up to date "
                    f"({self.skipped} samples; no damage recorded, its bytes were not re-read: "
                    f"`pipeline store verify {self.store}` checks them); nothing written")
        rate = self.encoded / self.loop_seconds if self.loop_seconds > 0 else 0.0
        line = (
            f"{self.stage}{where}: table '{self.table}' v{self.version}: encoded {self.encoded}, "
            f"reused {self.reused}, skipped (already done) {self.skipped}, quarantined {self.quarantined}, "
            f"{self.bytes_written / 1e6:.2f} MB written in {self.seconds:.1f} s (encoding {rate:.1f} samples/s)"
        )
        if self.repaired_from is not None:
            line += (f"; v{self.repaired_from} was recorded as damaged: its damaged samples recomputed, the rest "
                     f"carried forward, v{self.version} verified (v{self.repaired_from} moved to "
                     f"v{self.repaired_from}.damaged/)")
        if self.damaged:
            line += (f"\nskipped {len(self.damaged)} damaged input sample(s) of table 'images' (on_damaged=skip; "
                     f"quarantined as {DAMAGED_INPUT!r}): {few(self.damaged)}")
        return line


# ---------------------------------------------------------------- the job: inputs, writer, quarantine


@dataclass
class EncodeJob:
    store: Store
    images: TableReader
    lineage: Lineage
    ranks: Ranks
    summary: Summary
    started: float = field(default_factory=time.perf_counter)
    loop_started: float = 0.0
    writer: TableWriter | None = None
    feature_lineage: str = ""  # see store.reuse: samples with this lineage in earlier versions are carried
    earlier_lineages: tuple[str, ...] = ()  # the same features hashed as before the declared scheme: carried too
    match_columns: tuple[str, ...] = ()  # images columns a carried row must still match (vae: mask_sha256)
    lease: Any = None  # the read lease on `images` (store/lease.py); released when the job is done or collected
    on_damaged: str = "stop"  # a damaged `images` sample: stop, or skip (quarantined as DAMAGED_INPUT)
    max_damaged_fraction: float = 0.0  # on_damaged=skip: stop anyway above this share of this rank's samples
    repairing: int | None = None  # the current version, recorded as damaged: verify the new one after commit
    _total: int = 0
    _quarantine_rows: list[dict[str, Any]] = field(default_factory=list)
    _shard_sizes_before: dict[str, int] = field(default_factory=dict)

    @property
    def up_to_date(self) -> bool:
        return self.summary.up_to_date

    def open_writer(self, schema: TableSchema, shard_size_mb: float) -> list[str]:
        """Open (or resume) the output version, carry forward every key an earlier version with the same feature
        lineage holds (hard-linked shards, split relabelled from `images`); return this rank's keys left to do."""
        schema = replace(schema, attrs={**schema.attrs, FEATURE_LINEAGE_ATTR: self.feature_lineage})
        self.writer = self.store.writer(
            self.summary.table, schema, rank=self.ranks.rank, world_size=self.ranks.world_size,
            shard_size_mb=shard_size_mb,
        )
        if self._completed_meanwhile():
            return []
        self.summary.version = self.writer.version
        self._shard_sizes_before = self._rank_shard_sizes()
        mine = self.images.iter_keys(rank=self.ranks.rank, world_size=self.ranks.world_size)
        self._total = len(mine)
        todo = [k for k in mine if k not in self.writer.done_keys]
        self.summary.skipped = len(mine) - len(todo)
        for version, rows in reusable(self.store, self.summary.table, (self.feature_lineage, *self.earlier_lineages), todo).items():
            rows = self._same_content(rows)
            split = {k: self.images.meta(k).get("split", "train") for k in rows.column("key").to_pylist()}
            self.summary.reused += carry_forward(self.writer, version, rows, {"split": split})
        if self.summary.reused:
            todo = [k for k in todo if k not in self.writer.carried_keys]
        self.loop_started = time.perf_counter()
        return todo

    def _same_content(self, rows):
        """Rows whose `match_columns` (content outside the key, e.g. the mask) equal the images row's now; a
        value unknown on either side (older tables) never matches, so such a sample is recomputed."""
        if not self.match_columns or not rows.num_rows:
            return rows
        import pyarrow as pa

        keep = []
        for i, k in enumerate(rows.column("key").to_pylist()):
            meta = self.images.meta(k)
            keep.append(all(c in rows.column_names and meta.get(c) is not None
                            and rows.column(c)[i].as_py() == meta.get(c) for c in self.match_columns))
        return rows.filter(pa.array(keep, pa.bool_()))

    def _completed_meanwhile(self) -> bool:
        """Another process finished this very table (same lineage) after our up-to-date check, while we loaded
        the model: reuse it ("up to date") instead of writing a duplicate version."""
        assert self.writer is not None
        found = self.store.find_version(self.summary.table, self.lineage)
        if found is None:
            return False
        mine = self.writer.dir
        self.writer.close()
        self.writer = None
        if self.ranks.rank == 0 and not any(mine.glob("shard-*")):  # the empty folder this run just created
            shutil.rmtree(mine, ignore_errors=True)
        self.adopt(found)
        return True

    def adopt(self, found: int) -> None:
        """Reuse the complete version `found` of this lineage: make it current (a run killed after its manifest,
        before the store.json switch, left it not current) and report the table up to date."""
        self.store.set_current(self.summary.table, found)
        self.summary.version, self.summary.up_to_date = found, True
        with self.store.reader(self.summary.table, found) as done:
            self.summary.skipped = len(done)

    def read_inputs(self, keys: list[str]) -> Iterator[tuple[str, dict[str, Any] | Rejected]]:
        """(key, `images` sample) in order, every sample's bytes checked before they are returned (a check-ahead
        thread verifies the next ones while the encoder works, store/check_ahead.py). With on_damaged=skip a
        damaged sample comes as a `Rejected` (quarantined as DAMAGED_INPUT by `accepted`) instead of raising."""
        from store.integrity import DamagedData

        self.images.check_ahead([self.images.row_of(k) for k in keys])
        for key in keys:
            try:
                sample: dict[str, Any] | Rejected = self.images.get(key)
            except DamagedData as e:
                if self.on_damaged != "skip":
                    raise
                sample = Rejected(DAMAGED_INPUT, str(e), key=key)
            yield key, sample

    @staticmethod
    def unless_rejected(prepare: Callable[[tuple[str, Any]], R]) -> Callable[[tuple[str, Any]], R | Rejected]:
        """`prepare` for read samples; a `Rejected` input (a damaged one) passes through as it is."""
        return lambda item: item[1] if isinstance(item[1], Rejected) else prepare(item)

    def progress(self, total: int) -> "SampleProgress":
        """Samples/s is tqdm's rate; one bar per rank (stages/encode/progress.py)."""
        from stages.encode.progress import SampleProgress

        r = self.ranks
        desc = self.summary.stage + (f" r{r.rank}" if r.world_size > 1 else "")
        return SampleProgress(total, desc, position=r.rank)

    def quarantine(self, key: str, reason: str, detail: str = "") -> None:
        """Reject one sample (it stays out of the table); the rows land in quarantine.parquet at `finish`."""
        source = self.images.meta(key).get("source") or f"images/v{self.images.version}/{key}"
        self._quarantine_rows.append({
            "key": key, "source": str(source), "stage": self.summary.stage, "reason": reason, "detail": detail,
            "table_version": f"{self.summary.table}/v{self.summary.version}",
        })
        self.summary.quarantined += 1

    def accepted(self, prepared: Iterable[T | Rejected], bar: "SampleProgress") -> Iterator[T]:
        """Pass prepared samples through; quarantine the rejected ones (they count as done on the bar)."""
        for item in prepared:
            bar.sample_read()
            if isinstance(item, Rejected):
                self.quarantine(item.key, item.reason, item.detail)
                bar.skipped()
                if item.reason == DAMAGED_INPUT:
                    self._damaged_input(item.key, item.detail)
            else:
                yield item

    def _damaged_input(self, key: str, problem: str) -> None:
        self.summary.damaged[key] = problem
        n, total = len(self.summary.damaged), max(self._total, 1)
        if n > self.max_damaged_fraction * total:
            section = self.summary.stage.replace("-", "_")
            raise UserError(
                f"{n} of {total} samples of table 'images' v{self.images.version} in {self.store.root} are damaged, "
                f"more than {section}.max_damaged_fraction {self.max_damaged_fraction} (e.g. {problem})")

    @contextmanager
    def timed_forward(self, items: int) -> Iterator[None]:
        """Time spent in the model (a GPU is synchronised so its queued work counts here, not after)."""
        t0 = time.perf_counter()
        yield
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.summary.forward_seconds += time.perf_counter() - t0
        self.summary.forwards += 1
        self.summary.forward_items += items

    def finish(self) -> Summary:
        """Quarantine rows, this rank's last shard, rank 0 commits (manifest last). Both parts are agreed on by
        all ranks (models/collective.py; they are the barriers too): a rank that fails (a full disk, its
        damaged-input threshold, in `failed` for a failure in its loop) stops every rank with its one line."""
        from models.collective import together

        if self.summary.up_to_date:  # completed by another process meanwhile (see open_writer)
            self.summary.seconds = time.perf_counter() - self.started
            return self.summary
        assert self.writer is not None
        world, stage = self.ranks.world_size, self.summary.stage
        with together(world, f"{stage}: this rank's last shard"):
            self._flush_quarantine()
            self.writer.finish_rank()
            self.summary.loop_seconds = time.perf_counter() - self.loop_started
            self.summary.bytes_written = sum(
                size - self._shard_sizes_before.get(name, 0) for name, size in self._rank_shard_sizes().items()
            )
            self.images.stop_check_ahead()
        with together(world, f"{stage}: the commit of table '{self.summary.table}'"):
            if self.ranks.rank == 0:
                self.summary.version = self.writer.commit(allow_empty=False)
                if self.repairing is not None:
                    self._verify_repaired()
            else:
                self.writer.close()
        self.summary.seconds = time.perf_counter() - self.started
        if self.lease is not None:
            self.lease.release()
        return self.summary

    def _verify_repaired(self) -> None:
        """The version that replaces one recorded as damaged is read back in full (as `store verify`)."""
        from store.verify import verify_version

        table, v = self.summary.table, self.summary.version
        problems = verify_version(self.store.version_dir(table, v), f"{table}/v{v}", progress=False)
        if problems:
            raise UserError(f"table '{table}' v{v} (recomputed from damaged v{self.repairing}) does not verify: "
                            f"{problems[0]}; run `pipeline store repair {self.store.root}`")
        self.summary.repaired_from = self.repairing
        from store.repair import set_aside

        from tqdm.auto import tqdm

        tqdm.write(f"{self.summary.stage}: {set_aside(self.store.version_dir(table, self.repairing))}")

    def close(self) -> None:
        """Give up the writer lock without committing (on error; a rerun resumes from committed shards); close
        the `images` reader and release its lease (idempotent: also the end of a finished or up-to-date job)."""
        self.images.close()
        if self.writer is not None:
            self.writer.close()
        if self.lease is not None:
            self.lease.release()

    def failed(self, error: BaseException) -> None:
        """This rank failed in its own part of the work (its loop): the other ranks learn it at their next
        agreement (`finish`) instead of waiting for this rank there (models/collective.py)."""
        from models.collective import share_failure

        share_failure(self.ranks.world_size, error, self.summary.stage)

    def _rank_shard_sizes(self) -> dict[str, int]:
        assert self.writer is not None
        return {p.name: p.stat().st_size for p in Path(self.writer.dir).glob(f"shard-r{self.ranks.rank:02d}-*.tar")
                if p.name not in self.writer.linked_shards}  # carried shards are not written bytes

    def _flush_quarantine(self) -> None:
        """Rows this table version already quarantined are not repeated (a resumed run retries those samples)."""
        self.store.add_quarantine(self._quarantine_rows)
        self._quarantine_rows = []


def open_job(store_path: str | Path, stage: str, table: str, feature_hash: str, model: str,
             feature_revision: str, ranks: Ranks, components: tuple[str, ...] = (), on_damaged: str = "stop",
             max_damaged_fraction: float = 0.0, earlier_hashes: tuple[str, ...] = ()) -> EncodeJob:
    """`_open_job` on every rank, then agreed on (models/collective.py): a rank that cannot open its inputs
    stops every rank with its line before any model is loaded (the others would wait at the commit)."""
    from models.collective import together

    job = None
    try:
        with together(ranks.world_size, f"{stage}: opening the inputs"):
            job = _open_job(store_path, stage, table, feature_hash, model, feature_revision, ranks, components,
                            on_damaged, max_damaged_fraction, earlier_hashes)
    except BaseException:
        if job is not None:  # another rank failed: this one's reader and lease go now
            job.close()
        raise
    return job


def _open_job(store_path: str | Path, stage: str, table: str, feature_hash: str, model: str,
              feature_revision: str, ranks: Ranks, components: tuple[str, ...] = (), on_damaged: str = "stop",
              max_damaged_fraction: float = 0.0, earlier_hashes: tuple[str, ...] = ()) -> EncodeJob:
    """Read the `images` table, build the lineage, and find out whether an identical version already exists.

    An identical complete version is made current and reused ("up to date"); anything that differs (model
    fingerprint, config, images version, code revision) leads to a new version, never a silent reuse.
    """
    from models.loading import component_fingerprint, model_fingerprint

    path = Path(store_path)
    if not (path / "store.json").is_file():
        raise UserError(f"no store at {path} (no store.json); run `pipeline run resize-bucket --store {path}` first")
    store = Store(path, create=False)
    # A read lease on the images version (store/lease.py): `store gc` keeps it while this stage reads it.
    lease = hold(store.root, {IMAGES_TABLE: None}, stage)
    images = store.reader(IMAGES_TABLE, lease.version(IMAGES_TABLE), on_damaged=on_damaged)
    # The images version's identity (not just its number) goes into the hash: a deleted and rebuilt images
    # table restarts at v1 with other contents, and must not match features encoded from the old one.
    images_id = store.version_id(IMAGES_TABLE, images.version)
    lineage = Lineage(
        stage=stage, config_hash=f"{feature_hash}-images:{images_id}", model_fingerprint=model_fingerprint(model),
        upstream={IMAGES_TABLE: images.version}, code_version=code_version(feature_revision),
    )
    summary = Summary(stage=stage, table=table, rank=ranks.rank, world_size=ranks.world_size, store=str(path))
    # Per-sample reuse: the features depend on these settings, the components loaded and the images' own
    # feature lineage (render settings), not on the images version (a relabelled split is the same pixels).
    upstream = images.schema.attrs.get(FEATURE_LINEAGE_ATTR) or images_id
    origin = images.schema.attrs.get("migrated_from")  # v1 -> v2 migration: the very same pixels
    if FEATURE_LINEAGE_ATTR not in images.schema.attrs and origin is not None and \
            (store.version_dir(IMAGES_TABLE, int(origin)) / "manifest.parquet").is_file():
        upstream = store.version_id(IMAGES_TABLE, int(origin))
    fingerprint = component_fingerprint(model, components) if components else model_fingerprint(model)
    fl, *earlier = (feature_lineage(stage, h, fingerprint, code_version(feature_revision), upstream)
                    for h in (feature_hash, *earlier_hashes))
    # The same features as hashed before the declared lineage scheme (tables encoded then stay current, and
    # `store repair` of such a table resumes its repair version under its own lineage).
    hashed_before = [(replace(lineage, config_hash=f"{h}-images:{images_id}"), e) for h, e in zip(earlier_hashes, earlier)]
    lineage, fl = next(((old, e) for old, e in hashed_before if repair_context.expected() == old), (lineage, fl))
    repair_context.check(lineage, table)
    job = EncodeJob(store=store, images=images, lineage=lineage, ranks=ranks, summary=summary, feature_lineage=fl,
                    earlier_lineages=tuple(earlier), lease=lease, on_damaged=on_damaged,
                    max_damaged_fraction=max_damaged_fraction)
    weakref.finalize(job, lease.release)
    found = store.find_version(table, lineage)  # never a version recorded as damaged
    for old, _ in hashed_before if found is None else ():
        found = store.find_version(table, old)
        if found is not None:
            break
    if found is not None:
        job.adopt(found)
        summary.seconds = time.perf_counter() - job.started
        job.close()  # nothing to read: the stage returns the summary
        return job
    current = store.tables().get(table)
    if current is not None and fmt.damaged_marker(store.root, table, current).exists() and not repair_context.active():
        from tqdm.auto import tqdm

        job.repairing = current
        tqdm.write(f"{stage}: table '{table}' v{current} is recorded as damaged "
                   f"({fmt.damaged_marker(store.root, table, current)}): recomputing its damaged samples into a new "
                   "version, carrying the intact ones forward")
    return job


def control_count_rejection(variant: str, num_controls: int, key: str) -> Rejected | None:
    """The model-variant rule both encode stages apply, so an Edit (v1) model drops the same samples from the
    `text` and the `vae` table: Edit takes exactly one control image, Edit-Plus any number."""
    if variant == "edit" and num_controls != 1:
        return Rejected("edit model needs exactly one control image",
                        f"sample has {num_controls}; use an Edit-Plus model for 0 or several controls", key=key)
    return None


# ---------------------------------------------------------------- data flow: prefetch and shape-grouped batches


def prefetched(items: Iterable[T], load: Callable[[T], R], workers: int = 2, depth: int = 32) -> Iterator[R]:
    """`map(load, items)` in order, with up to `depth` loads running ahead in threads (PNG decode and
    preprocessing overlap the model forward; PIL and numpy release the GIL for the heavy parts)."""
    if workers <= 0:
        yield from map(load, items)
        return
    pending: list = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for item in items:
            pending.append(pool.submit(load, item))
            if len(pending) >= depth:
                yield pending.pop(0).result()
        for f in pending:
            yield f.result()


def batches_by_shape(items: Iterable[T], shape_of: Callable[[T], Hashable | None], batch_size: int,
                     window: int | None = None) -> Iterator[list[T]]:
    """Batches whose items all share one input shape, so no padding enters the forward and each result is
    bit-for-bit the one the item gets alone (padding and mixed shapes change float rounding).

    `shape_of` returning None sends the item alone. Items wait in per-shape groups; a full group is emitted at
    once; when more than `window` items wait, the largest group goes out partly filled; at the end every group
    is flushed.
    """
    window = 8 * batch_size if window is None else window  # bounds memory: waiting items hold their pixels
    groups: OrderedDict[Hashable, list[T]] = OrderedDict()
    waiting = 0
    for item in items:
        shape = shape_of(item)
        if shape is None:  # the item must run alone
            yield [item]
            continue
        group = groups.setdefault(shape, [])
        group.append(item)
        waiting += 1
        if len(group) >= batch_size:
            yield groups.pop(shape)
            waiting -= batch_size
        elif waiting > window:
            biggest = max(groups, key=lambda s: len(groups[s]))
            batch = groups.pop(biggest)
            waiting -= len(batch)
            yield batch
    for batch in groups.values():
        yield batch


def open_png(data: bytes, mode: str = "RGB") -> Image.Image:
    """A stored PNG as a PIL image (the images table holds sanitised 8-bit PNGs)."""
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        return im.convert(mode) if im.mode != mode else im.copy()
