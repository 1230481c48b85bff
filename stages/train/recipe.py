"""`train` stage: `text` + `vae` tables -> a LoRA run directory (DESIGN §6), as a recipe.

    run = setup(...)               check config, open inputs and run folder, build model + optimizer, resume
    while run.step < max_steps:    (train_steps)
        stats = step(run)          grad_accum micro-batches: flow matching on mixed-resolution batches
        log(run, stats)            TensorBoard scalars, progress bar
        checkpoint(run)            every checkpoint_every steps and at the end
        validate(run)              held-out loss / sample grid when due (after the checkpoint: a failure loses
                                   no training)
    finish(run)                    the final LoRA
    cleanup(run)                   after a finished run or an error: close whatever setup opened

Each is a small function over `Run`, the recipe's state; the phases other than the step live in modules of
their own: `settings.py` (config checks, fingerprint, precision, devices), `start.py` (the inputs, where this
start begins: fresh, resumed or the previous run kept), `build.py` (transformer, adapter, optimizer, sampler,
data stream), `schedule.py` (optimizer + LR schedule), `saving.py` (checkpoint, final LoRA, cleanup),
`result.py` (`TrainResult`), `current.py` (the up-to-date check of `skip_if_done`) and `stop.py` (a SIGTERM
finishes and checkpoints the step under way, on every rank alike; under grad_accum > 1 it drops the partial step at
the next micro-batch boundary and stops with the last completed step's checkpoint). Only the transformer is
loaded, never the text encoder or the VAE: the store already holds their outputs.

RUN/
  checkpoints/step-N/   LoRA + optimizer + scheduler + RNG + data position (stages/train/state.py)
  lora/                 the final adapter, diffusers format (`pipeline.load_lora_weights(RUN/lora)`)
  logs/                 TensorBoard scalars
  train_config.yaml     the effective config of the latest start

Data parallel (accelerate launch, 1..N processes): each optimizer step takes `grad_accum` global micro-batches
from the length-aware (or token-budget, `stages/train/budget.py`) sampler; each rank computes its share, its
loss scaled by world_size / (samples in the whole step), and PyTorch DDP (`stages/train/parallel.py`, `no_sync`
on all but the last micro-batch) averages the LoRA gradients during the last backward, which gives every rank
the gradient of the mean per-sample loss over the whole step. Micro-batches are prepared inline or ahead by a
thread (`stages/train/prefetch.py`, `train.prefetch`). Per-sample σ, noise and caption
dropout come from (seed, optimizer step, key) (and a sample's repeat within the step: models/randomness.py), so
1 process and N processes train the same LoRA, and so do batch B x grad_accum A and batch B*A when the sampler puts the same samples in the step. The global torch
RNG (saved per rank in checkpoints) only feeds LoRA dropout, which is therefore not layout-independent.
The sampler's global steps are planned for the run's first world size, so a resume on another process count
splits the same steps over its ranks and trains the same LoRA (`stages/train/elastic.py`).
A checkpoint also keeps the trackers' running figures (the step losses since the last log point, the epoch's
token counts), so a resume off the log cadence or mid-epoch logs the straight run's curve.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from models.collective import fails_alone, together
from models.collective.frozen import lockstep, progressed
from models.flow import FlowBatch, flow_loss_of
from schemas.config import PipelineConfig, TrainConfig
from schemas.errors import UserError
from stages.train import guard, parallel, state as train_state
from stages.train.build import build_training, check_shapes, setup_transformer
from stages.train.current import resolved_train, up_to_date
from stages.train.damaged import DamageTally
from stages.train.data import DataStream
from stages.train.launch import launched_world_size
from stages.train.prefetch import MicroBatches
from stages.train.result import TrainResult
from stages.train.saving import checkpoint, cleanup, finish
from stages.train.sampler import padded_tokens
from stages.train.settings import (make_accelerator, resolved_config, run_backend, say_other_shift, scheduler_config,
                                   sigma_for_model, train_device, validate_config, zero_token_weights)
from stages.train.start import check_same_start, open_tables, prepare_run_dir, resume_point, start_record
from stages.train.state import ResumeRecord
from stages.train.stop import StopOnSignal
from store.format import atomic_write_json
from store.join import JoinedTables

def step_oom_advice(tc: TrainConfig) -> str:
    """What to change when a step runs out of memory (named in the error every rank prints), for this run's
    settings: what it names to set is left out where already set (checkpointing,
    block offload, a quantized base), and with train.uncheckpointed_blocks set (`pipeline plan --gpu-memory` may
    have advised raising it) lowering it comes first: each such block keeps its activations through the backward."""
    unset = [name for name, on in (("train.gradient_checkpointing", tc.gradient_checkpointing),
                                   ("train.offload: blocks", tc.offload == "blocks"),
                                   ("train.quantize_base", tc.quantize_base != "none")) if not on]
    advice = "lower train.batch_size or train.max_tokens_per_batch"
    if unset:
        advice += f", or set {', '.join(unset[:-1])}{' or ' if len(unset) > 1 else ''}{unset[-1]}"
    advice += " (`pipeline plan` predicts the peak)"
    if tc.uncheckpointed_blocks > 0:  # set only with checkpointing on (`check_checkpointing`)
        return (f"lower train.uncheckpointed_blocks ({tc.uncheckpointed_blocks}: blocks that keep their activations) "
                f"or {advice}")
    return advice


# ... and when the update does: Adam's state (two float32 copies of the adapter) is allocated at the first step
OPTIMIZER_OOM_ADVICE = ("set train.optimizer: adamw8bit or adafactor (a smaller optimizer state), lower "
                        "train.lora.rank, or set train.offload: blocks or train.quantize_base (`pipeline plan` "
                        "predicts the peak)")


@dataclass
class Run:
    """The recipe's state: what every phase reads and advances."""

    cfg: TrainConfig
    accelerator: Any
    tables: JoinedTables
    run_dir: Path
    record: ResumeRecord  # what this start trains on; step/epoch/batch filled in at each checkpoint
    transformer: Any = None
    params: list[torch.nn.Parameter] = field(default_factory=list)
    optimizer: Any = None
    scheduler: Any = None
    stream: DataStream | None = None
    model: Any = None  # what the forward calls: the DDP wrapper (several processes) or the transformer
    batches: MicroBatches | None = None  # the stream's micro-batches, prepared inline or ahead
    position: tuple[int, int] = (0, 0)  # data position after the last micro-batch consumed
    step: int = 0
    writer: Any = None  # stages.train.trackers.Trackers (train.log_with), main process only
    bar: Any = None
    result: TrainResult | None = None
    epoch_tokens: list[int] = field(default_factory=lambda: [0, 0])  # valid, computed of the current epoch
    ended_tokens: list[int] = field(default_factory=lambda: [0, 0])  # of the epochs ended in this step (main process)
    # the padding lines of the epochs ended in this step, said when it completes (`_log_ended_epochs`): a step
    # dropped at a stop is run again by the resume, which says them then (main process)
    ended_lines: list[str] = field(default_factory=list)
    carried_losses: list[float] = field(default_factory=list)  # the last step losses before this start (its checkpoint's)
    # [valid, computed] tokens of each of the last steps, the checkpoint's before this start's: a log point's window
    step_tokens: list[tuple[int, int]] = field(default_factory=list)
    step_running_tokens: list[int] = field(default_factory=lambda: [0, 0])  # valid, computed of this step so far
    logged_step: int = 0  # the last step whose scalars the trackers got (`log_point`)
    ema: Any = None  # stages.train.ema.AdapterEMA with train.ema_decay
    validator: Any = None  # stages.train.validate.Validator with train.validate_every / sample_every
    profiler: Any = None  # stages.train.trackers.StepProfiler with train.profile
    train_device: torch.device | None = None  # train.device for this rank (None: accelerate's choice)
    new_run: bool = False  # keep the run the folder holds (stages.train.previous) instead of refusing it
    before_keep: Callable[[Path], None] | None = None  # called with RUN just before it is kept (run all: report)
    kept_previous: Path | None = None
    run_lock: Any = None  # the lock of the fresh RUN after a keep (the first one moved with the kept run)
    damage: DamageTally | None = None  # train.on_damaged=skip: samples left out, the agreed limit
    # a SIGTERM seen by this rank, agreed at the next step or micro-batch boundary (stages/train/stop.py)
    stop: StopOnSignal | None = None
    rerun: str = "rerun with --resume"  # how the user continues this run (`run all`: the same command)
    resume_bytes: dict[str, bytes] | None = None  # the resumed checkpoint's files, read once by its check (restore)
    precision: Any = None  # models.precision.Precision: what the base loads and computes in, and why (agreed)

    @property
    def device(self) -> torch.device:
        return self.train_device or self.accelerator.device

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @cached_property
    def oom_advice(self) -> str:
        """`step_oom_advice` of the run's config, built once (every step names it to `fails_alone`)."""
        return step_oom_advice(self.cfg)

    def logged_losses(self, n: int) -> list[float]:
        """The last `n` step losses of the run, those of the start before this one (the checkpoint's) included:
        a log point's window may begin before the resume."""
        if n <= 0:
            return []
        own = self.result.losses[-n:].tolist()
        missing = n - len(own)  # steps of the window before this start (as many as the checkpoint kept)
        return (self.carried_losses[-missing:] if missing > 0 else []) + own


@dataclass
class StepStats:
    loss: float
    epoch: int  # the epoch the step began in
    samples: int
    grad_norm: float
    seconds: float  # compute + data, up to the loss sync
    data_seconds: float  # of which waiting for this rank's micro-batches (reads + preparation, or an empty queue)
    started: float  # perf_counter / process_time at the step's start: `log` adds its own time to the step's
    cpu_started: float
    lr: float = 0.0  # the (first group's) learning rate this step trained with
    stop: bool = False  # a rank was sent SIGTERM: checkpoint this step and stop (every rank alike)

# ---------------------------------------------------------------------------------------------- the recipe


def run(
    cfg: PipelineConfig, store: str | Path, model: str, out: str | Path, resume: bool = False,
    skip_if_done: bool = False, new_run: bool = False, before_keep: Callable[[Path], None] | None = None,
    rerun: str = "rerun with --resume",
) -> TrainResult:
    """Train (or, with `resume`, continue from OUT's last checkpoint). `skip_if_done`: return at once when OUT
    already holds the final LoRA of a run on the same tables, model and config (`pipeline run all`).
    `new_run`: a run in OUT that cannot be continued (without `resume`: any trained run) is kept as
    OUT.previous/N-TIME (stages/train/previous.py) and training starts afresh; `before_keep(OUT)` runs first.
    `rerun`: how the user continues after a stop (named in a full disk's line and a SIGTERM's)."""
    started = time.perf_counter()
    validate_config(cfg.train)
    check_sampling(cfg.train, model)  # every rank alike, before any work
    scheduler = scheduler_config(model)  # read once, where the σ settings need it, for both uses below
    cfg = sigma_for_model(cfg, model, scheduler)  # before the finished-run check and the fingerprint
    world = launched_world_size()
    accelerator = make_accelerator(cfg.train) if world > 1 else None  # the ranks' process group, to decide together
    main = accelerator is None or accelerator.is_main_process
    if skip_if_done and finished_here(cfg, store, model, out, world, main):
        lora = Path(out) / "lora"
        return TrainResult(Path(out), lora, cfg.train.max_steps, cfg.train.max_steps, up_to_date=True,
                           unapplied=_unapplied(Path(out), cfg))
    accelerator = accelerator or make_accelerator(cfg.train)
    if accelerator.is_main_process:
        say_other_shift(cfg.train.sigma, model, scheduler)
    locks = _lock_run_folder(cfg.train, accelerator, Path(out))
    r, moved = None, None
    try:
        if skip_if_done and new_run and world == 1:
            taken, moved = take_back_kept(cfg, store, model, Path(out), before_keep, locks, resume)
            if taken is not None:
                return taken
        from models.shared_folder import check_shared

        check_shared(Path(out), accelerator.num_processes, accelerator.process_index, "--out",
                     "rank 0 writes each checkpoint, every rank adds its RNG state and reads it on --resume")
        r = setup(cfg, store, model, out, resume, accelerator, new_run=new_run, before_keep=before_keep, locks=locks,
                  rerun=rerun)
        train_steps(r)
        result = finish(r)
        result.kept_previous = result.kept_previous or moved  # a kept run taken back to resume: where OUT's went
        stopped_late(r)
        result.seconds = time.perf_counter() - started
        return result
    finally:
        cleanup(r, locks)


def _lock_run_folder(tc: TrainConfig, accelerator, out: Path) -> list:
    """The run folder's lock, as the first entry of the list `run` releases at the end (None on the other ranks).
    One writer per run folder: a second `train` into the same OUT is refused, naming the holder. Only rank 0
    locks, so every rank learns of its refusal here (models/collective/), instead of waiting for it at the
    first collective while it exits. The trackers are rank 0's, checked there in the same agreement (alone, a
    node without one stopped, and the others met its closed connection, told of a rank killed without a word)."""
    from stages.train.trackers import tracker_classes

    locks: list = []
    with together(accelerator.num_processes, "the trackers and the run folder's lock"):
        if accelerator.is_main_process:
            tracker_classes(tc.log_with)
        locks.append(guard.RunDirLock(out) if accelerator.is_main_process else None)
    return locks


def train_steps(r: Run) -> None:
    """The steps from where `setup` left the run to max_steps, each logged, checkpointed when due and validated
    when due; a stop signal ends them after the checkpoint it asks for (`_stop_after_checkpoint`), or drops the
    step under way at a micro-batch boundary and ends them at the last completed step's (`_stop_mid_step`)."""
    if r.validator is not None and r.step > 0:  # a validation due at the resumed step (a failure there came
        r.validator(r)  # after its checkpoint): the validator runs only what it left unrecorded
    saved_at, stats = r.step, None  # the last step with a checkpoint (a resumed start's; 0: none)
    with StopOnSignal() as r.stop, lockstep():  # a frozen peer stops every rank (models/collective/frozen.py)
        while r.step < r.cfg.max_steps:
            done = step(r)
            progressed()
            if done is None:  # a signal agreed at a micro-batch boundary: the partial step was dropped
                _stop_mid_step(r, stats, saved_at)
            stats = done
            log(r, stats)
            # checkpoint first: a validation that fails (out of memory generating samples) loses no training
            saved = r.step % r.cfg.checkpoint_every == 0 or r.step == r.cfg.max_steps or stats.stop
            if saved:
                checkpoint(r)
                saved_at = r.step
            _stop_after_checkpoint(r, stats, saved)
            if r.validator is not None:
                r.validator(r)


def _stop_after_checkpoint(r: Run, stats: StepStats, saved: bool) -> None:
    """Every rank stops here alike when a signal asked for it: the flag came with the step's loss, or (a signal
    while the checkpoint was written) is agreed right after it, so the checkpoint just written is the resume point
    without one more step."""
    if r.step < r.cfg.max_steps and (stats.stop or saved and r.stop.pending(r.world)):
        log_point(r, stats)  # this start's curve ends where its checkpoint does, as a finished run's
        r.stop.stop_now(f"stopped by {r.stop.by()} after optimizer step {r.step}: its checkpoint "
                        f"{r.checkpoints / f'step-{r.step}'} is written; {r.rerun} to continue from it"
                        if r.main else None)


def _stop_mid_step(r: Run, last: StepStats | None, saved_at: int) -> None:
    """Every rank stops here alike after dropping a partial step (`step`): the last completed step's checkpoint
    is the resume point, written now unless it exists (a due one, or the resumed one); none before the first."""
    if r.step > saved_at:
        checkpoint(r)
    if last is not None:
        log_point(r, last)  # this start's curve ends where its checkpoint does
    if r.step == 0:
        line = (f"stopped by {r.stop.by()} during optimizer step 1, before any step completed: nothing is kept; "
                f"{r.rerun} to start again")
    else:
        line = (f"stopped by {r.stop.by()} during optimizer step {r.step + 1} (its partial gradients dropped): the "
                f"checkpoint of optimizer step {r.step}, {r.checkpoints / f'step-{r.step}'}, is written; "
                f"{r.rerun} to continue from it")
    r.stop.stop_now(line if r.main else None)


def _unapplied(out: Path, cfg: PipelineConfig) -> list[str]:
    """The settings acting only while training that an up-to-date skip leaves undone (`resume.unapplied_settings`:
    a validation curve or sample grids asked for now, which the finished run was trained without)."""
    from stages.train.resume import unapplied_settings

    return unapplied_settings(out, cfg.model_dump(mode="json"))  # as train_config.yaml records it (dump_config)


def finished_here(cfg: PipelineConfig, store: str | Path, model: str, out: str | Path, world: int,
                  main: bool = True) -> bool:
    """`up_to_date`, decided by every rank together: done only where every rank sees the finished run. Each rank
    reads OUT's records and the store itself; one that returned while the others trained would leave them waiting
    for it in their first collective (a lagging view of OUT on one node). The final LoRA's bytes are read by the
    `main` rank alone (its CRC against checksums.json: the whole file, once, not once per rank from the shared
    folder); its answer reaches every rank through the same agreement."""
    from models.collective import all_max

    # the precision the ranks would train in: agreed (a collective) outside `together`; one process: as before
    train = resolved_train(cfg, world) if world > 1 else None
    backend = None
    if world > 1:  # the attention backend too (a collective: every rank probes, all decide together)
        from stages.train.settings import planned_device

        backend = run_backend(train, model, planned_device(train), world)
    with together(world, "is the run up to date"):
        done = up_to_date(cfg, store, model, out, train, backend, check_bytes=main)
    return not all_max(world, [int(not done)])[0]


def take_back_kept(cfg: PipelineConfig, store: str | Path, model: str, out: Path,
                   before_keep: Callable[[Path], None] | None, locks: list,
                   resume: bool = True) -> tuple[TrainResult | None, Path | None]:
    """`run all` (one process, the run folder locked): the newest run kept in OUT.previous that is the finished run
    of these very settings and inputs (`up_to_date`, as for OUT itself) is renamed back to OUT, the run OUT held kept
    in its place (`previous.take_back`; `before_keep(OUT)` first, as for any keep), and returned as up to date
    (with where OUT's run went, or None).
    Settings A, then B, then A again: the third run is the first's, trained again before. With no finished one, and
    OUT no run these settings resume: the kept run of them a resume continues (`resumable_step`, the furthest) is
    taken back the same way and None returned, so the start resumes it (A stopped half-way, B, A: A goes on from
    its last checkpoint, not from step 0; only with `resume`). (None, None), nothing moved, when there is neither.
    OUT's lock is taken again after a swap (`locks`): the one held moved away with the run OUT held."""
    from stages.train import previous
    from stages.train.current import resumable_step
    from stages.train.settings import config_fingerprint, earlier_config_fingerprints, planned_device, weighed

    train = resolved_train(cfg)
    backend = run_backend(train, model, planned_device(train))
    # a cheap look: the weights named as their default too (a run on tables without masks, `weighed`)
    fingerprints = {config_fingerprint(train), config_fingerprint(weighed(train, False)),
                    *earlier_config_fingerprints(train, backend)}
    partial: list[tuple[int, Path]] = []
    for kept in previous.kept_runs(out):
        latest = train_state.latest_checkpoint(kept / "checkpoints")
        try:  # a cheap look first: only a run of this config has its tables opened (`up_to_date`)
            if latest is None or ResumeRecord.read(latest / train_state.RESUME_JSON).config_fingerprint not in fingerprints:
                continue
            finished = up_to_date(cfg, store, model, kept, train, backend)
            step = None if finished else resumable_step(cfg, store, model, kept, train, backend)
        except UserError:  # a damaged kept run is left where it is, never taken back
            continue
        if finished:
            moved = _swap(out, kept, before_keep, locks, "the finished run")
            return TrainResult(out, out / "lora", cfg.train.max_steps, cfg.train.max_steps, up_to_date=True,
                               kept_previous=moved, unapplied=_unapplied(out, cfg)), moved
        if step is not None:
            partial.append((step, kept))
    if resume and partial and not _resumes(cfg, store, model, out, train, backend):
        return None, _swap(out, max(partial, key=lambda p: p[0])[1], before_keep, locks, "the run to continue")
    return None, None


def _resumes(cfg: PipelineConfig, store: str | Path, model: str, out: Path, train: TrainConfig,
             backend: str) -> bool:
    """OUT holds a run these settings resume (a damaged record: none; it is kept, as any run OUT holds)."""
    from stages.train.current import resumable_step

    try:
        return resumable_step(cfg, store, model, out, train, backend) is not None
    except UserError:
        return False


def _swap(out: Path, kept: Path, before_keep: Callable[[Path], None] | None, locks: list, what: str) -> Path | None:
    """`previous.take_back` of `kept` into OUT, then OUT locked again (appended to `locks`); returns where the run
    OUT held went, or None."""
    from stages.train import previous

    if before_keep is not None and previous.holds_trained_run(out):
        before_keep(out)
    moved = previous.take_back(out, kept)
    locks.append(guard.RunDirLock(out))
    tqdm.write(f"took back {what} of these settings from {kept} into {out}"
               + (f"; kept the run it held in {moved}" if moved is not None else ""))
    return moved


def stopped_late(r: Run) -> None:
    """A SIGTERM that came during the last step or its checkpoint (no step left to act on it at): once the final
    LoRA is written, the process stops as the signal asks (held and dropped, `run all` went on into evaluate until
    the scheduler's SIGKILL). Agreed by every rank (one all-reduce per run): a signal after the last step's loss
    all-reduce reached this rank alone."""
    from models.collective import all_max

    if all_max(r.world, [int(r.stop is not None and r.stop.signum is not None)])[0]:
        r.stop.stop_now(f"stopped by {r.stop.by()} after the last optimizer step {r.step}: the run is complete "
                        f"({r.result.lora_dir})" if r.main else None)


def setup(cfg: PipelineConfig, store: str | Path, model: str, out: str | Path, resume: bool = False,
          accelerator=None, *, new_run: bool = False, before_keep: Callable[[Path], None] | None = None,
          locks: list | None = None, rerun: str = "rerun with --resume") -> Run:
    """Check the config, open the inputs and the run folder (resume checks before any model is loaded), build
    the model, optimizer and sampler, restore a checkpoint. `locks`: the run folder's lock is appended there
    when a keep (`new_run`) makes a fresh folder."""
    if accelerator is None:  # `run` makes it first (the run-folder lock needs the process rank)
        validate_config(cfg.train)
        accelerator = make_accelerator(cfg.train)
    cfg = sigma_for_model(cfg, model)  # `run` resolved it already: then a no-op (every shift setting is set)
    chosen = train_device(cfg.train, accelerator.local_process_index, accelerator.num_processes)
    # the precision every rank trains in (decided by all: one DDP model in one dtype), before anything is hashed
    cfg, precision = resolved_config(cfg, chosen or accelerator.device, accelerator.is_main_process,
                                     accelerator.num_processes)
    tc = cfg.train
    # the attention backend every rank will use (one decision of all), recorded and compared beside the fingerprint
    backend = run_backend(tc, model, chosen or accelerator.device, accelerator.num_processes)
    tables = open_tables(tc, store, model, accelerator)
    now = start_record(tc, tables, model, accelerator.num_processes, backend)
    try:
        check_same_start(accelerator.num_processes, now)
    except BaseException:
        tables.close()
        raise
    r = Run(tc, accelerator, tables, Path(out), now, train_device=chosen, new_run=new_run, before_keep=before_keep,
            rerun=rerun, precision=precision)
    try:
        latest, resumed = resume_point(r, resume, cfg)
    finally:
        if locks is not None:
            locks.append(r.run_lock)
    # rank 0 writes (a full disk there stops every rank with its one line); also the barrier
    with together(r.world, "the run folder"), guard.one_line_errors("the run folder", r.run_dir):
        if r.main:
            prepare_run_dir(r, cfg, fresh=latest is None)
    with together(r.world, "hashing what the run reads"):
        if r.main:  # for the checkpoints' records; now, before any reader thread shares the tables' views
            tables.content_ids()

    r.transformer = setup_transformer(model, tc, r.device, r.world)
    if r.transformer._attention_choice.backend != backend:  # the one recorded is the one used, or nothing runs
        raise UserError(f"train.attention_backend: the model uses {r.transformer._attention_choice.backend}, but "
                        f"{backend} was decided before it loaded; report this")
    # which attention kernel this run uses and why (a failed packed probe's error included); rank 0 writes it,
    # every rank learns whether it could (the others would otherwise wait for it in DDP's first broadcast)
    with together(r.world, "attention.json"), guard.one_line_errors("attention.json", r.run_dir):
        if r.main:
            from models.attention import attention_record

            atomic_write_json(r.run_dir / "attention.json", attention_record(r.transformer))
    check_shapes(tables, r.transformer)
    build_training(r, store, model, latest, resumed)
    r.bar = tqdm(total=tc.max_steps, initial=r.step, desc="train", unit="step", disable=not r.main, dynamic_ncols=True)
    return r


def step(r: Run) -> StepStats | None:
    """One optimizer step: grad_accum global micro-batches, this rank's share of each (DDP all-reduces the
    gradients during the last backward), then the update. None, the step dropped and the run's state put back to
    its start, where a stop signal was agreed at a micro-batch boundary (grad_accum > 1: stages/train/stop.py).

    Collectives per step: DDP's gradient all-reduce and the loss sum, and under grad_accum > 1 the stop flag's
    all-reduce at each micro-batch boundary but the last (`StopOnSignal.at_micro_batch`, a host sync each); one
    more host sync (the loss, the finite check and the gradient norm read together). This rank's data, forward and backward, and its
    update, run in `fails_alone`: the others may be in DDP's all-reduce, so a failure here (a damaged sample, out of memory)
    is published to every rank instead of agreed on (models/collective/)."""
    tc, t0, c0 = r.cfg, time.perf_counter(), time.process_time()
    begun = _StepStart.of(r) if tc.grad_accum > 1 and r.stop is not None else None
    micro, data_seconds, n_step, loss_sum, damaged, weightless, step_losses = _accumulate(r, t0)
    if len(micro) < tc.grad_accum:  # stopped at a micro-batch boundary (`_accumulate`)
        begun.put_back(r)
        return None
    loss_sum, damaged, weightless, stop = _summed_over_ranks(r, loss_sum, damaged, weightless)
    if r.damage is not None or zero_token_weights(tc):  # DDP averaged with the planned count: rescaled to the
        # samples trained on (exactly 1.0 when none was left out)
        _rescale(r.params, n_step / (n_step - damaged - weightless).clamp(min=1))
    # gradients all-reduced by DDP, the loss here: every rank decides alike. Clipping a non-finite step's
    # gradients does no harm: they are dropped below.
    finite = guard.finite(loss_sum, r.params)
    norm = _clip(r.params, tc.max_grad_norm)
    figures = [t.float().to(loss_sum.device) for t in (loss_sum, finite, norm, damaged, weightless, stop)]
    total, ok, grad_norm, damaged, weightless, stop = torch.stack(figures).tolist()  # the step's one host sync
    intact = n_step - int(damaged)
    trained = intact - int(weightless)
    if r.damage is not None:
        r.damage.add(r.tables, int(damaged), n_step)  # over the limit: the same error on every rank, now
    if trained == 0:  # no update (the step counts; not a non-finite one)
        _trained_on_none(r, intact)
        ok, grad_norm = False, float("nan")
    elif ok:
        # this rank's own work too: the others go on to the next step's all-reduce (Adam's first step allocates
        # its state: out of memory there stopped every rank with a generic line and no advice)
        with fails_alone(r.world, f"optimizer step {r.step + 1}", OPTIMIZER_OOM_ADVICE):
            r.optimizer.step()
    else:  # every rank is here (the finite check is of all-reduced figures) and names the same samples
        _nonfinite(r, micro, step_losses)
        grad_norm = float("nan")
    lr = r.scheduler.get_last_lr()[0]  # what this step used: after `scheduler.step()` it is the next step's
    r.scheduler.step()
    if r.ema is not None:
        r.ema.update(r.step + 1)  # the optimizer step just taken (restored on a resume: the same warm-up)
    r.optimizer.zero_grad(set_to_none=True)
    r.step += 1
    loss = total / trained if trained else float("nan")
    return StepStats(loss, micro[0].epoch, intact, grad_norm, time.perf_counter() - t0, data_seconds, t0, c0, lr=lr,
                     stop=stop > 0)


@dataclass
class _StepStart:
    """What a step changes before its update, as it was at the step's start: a step dropped part-way (a stop
    signal) is checkpointed as the last completed step, which the resume then continues bit for bit."""

    position: tuple[int, int]
    epoch_tokens: list[int]
    ended_tokens: list[int]
    rng: dict[str, torch.Tensor]  # `state.rng_states`: LoRA dropout draws from them

    @classmethod
    def of(cls, r: Run) -> "_StepStart":
        rng = train_state.rng_states(cuda=r.device.type == "cuda")
        return cls(r.position, list(r.epoch_tokens), list(r.ended_tokens), rng)

    def put_back(self, r: Run) -> None:
        r.optimizer.zero_grad(set_to_none=True)  # the partial step's gradients
        r.position, r.epoch_tokens, r.ended_tokens = self.position, self.epoch_tokens, self.ended_tokens
        r.step_running_tokens, r.ended_lines = [0, 0], []
        train_state.set_rng_states(self.rng, cuda=r.device.type == "cuda")


def _summed_over_ranks(r: Run, loss_sum: torch.Tensor, damaged: int,
                       weightless: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss sum, damaged samples, samples of zero weight, a stop request: SIGTERM on any rank) of the step, summed
    over the ranks in the loss all-reduce; filled on the device (`new_full`: a kernel, where a host tensor's copy
    from pageable memory would wait for the backward)."""
    stop_requested = r.stop.requested() if r.stop is not None else 0.0
    summed = parallel.sum_over_ranks(torch.stack([loss_sum, loss_sum.new_full((), float(damaged)), weightless,
                                                  loss_sum.new_full((), stop_requested)]), r.world)
    return summed[0], summed[1], summed[2], summed[3]


def _trained_on_none(r: Run, intact: int) -> None:
    """A step with no sample to train on, said once (every rank is here: the counts are all-reduced)."""
    if intact == 0:
        r.result.damaged_steps.append(r.step + 1)
    if r.main:
        why = ("every sample damaged (train.on_damaged=skip)" if intact == 0 else
               "every intact sample weighs 0 in every token (train.loss.mask_weight)")
        r.bar.write(f"optimizer step {r.step + 1}: {why}, no update")


def _accumulate(r: Run, t0: float) -> tuple[list, float, int, torch.Tensor, int, torch.Tensor,
                                            list[tuple[list[int], torch.Tensor]]]:
    """`step`'s forward and backward passes over grad_accum micro-batches, in `fails_alone`: (the micro-batches,
    the seconds waited for them, the step's planned samples, this rank's loss sum, its samples left out as damaged,
    its samples of zero weight (device scalar), its rows and losses per micro-batch)."""
    tc = r.cfg
    step_losses: list[tuple[list[int], torch.Tensor]] = []  # this rank's rows and losses, for a non-finite step
    loss_sum = torch.zeros((), device=r.device)
    damaged = 0  # train.on_damaged=skip: this rank's planned samples left out as damaged (stages/train/damaged.py)
    weightless = torch.zeros((), device=r.device)  # this rank's samples whose every token weighs 0
    micro, data_seconds = [], 0.0
    with fails_alone(r.world, f"optimizer step {r.step + 1}", r.oom_advice):
        # the step's planned samples from the plan, not from its micro-batches: each is read, run and dropped in
        # turn, so one micro-batch's inputs sit on the device at a time, not grad_accum of them (and after an
        # elastic shrink not grad_accum x W0 / W planned batches', which the run was never sized for)
        n_step = r.stream.planned_samples(r.position, tc.grad_accum)
        for k in range(tc.grad_accum):
            waited = time.perf_counter()
            m = r.batches.next()
            data_seconds += time.perf_counter() - waited
            micro.append(m)
            parts = []
            for j, flow in enumerate(m.flows):  # several: this rank's share cut to the planned size (elastic.chunks)
                with parallel.accumulating(r.model, last=k == tc.grad_accum - 1 and j == len(m.flows) - 1):
                    parts.append(backward_of(r.model, flow, tc, r.device, scale=r.world / n_step))
            losses = torch.cat(parts) if len(parts) > 1 else parts[0]
            loss_sum += losses.sum()
            share = [i for i in m.global_batch[r.rank] if i not in m.damaged]
            if share and zero_token_weights(tc):  # (no share: the flows are a stand-in's, of no planned sample)
                weightless += sum(_weightless(fb) for fb in m.flows)
            step_losses.append((share, losses))
            _count_epoch_tokens(r, m)
            r.position = m.position
            progressed()
            m.flows = flow = []  # its inputs freed now (the step keeps its rows: the figures, a non-finite line)
            if m.damaged:
                damaged += len(m.damaged)
                r.damage.record(r.tables, m.damaged, r.step + 1)
            if k < tc.grad_accum - 1 and r.stop is not None and r.stop.at_micro_batch(r.world):
                break  # every rank alike: the step is dropped (`step`), the stop follows (`_stop_mid_step`)
    return micro, data_seconds, n_step, loss_sum, damaged, weightless, step_losses


def _weightless(fb: FlowBatch) -> torch.Tensor | int:
    """How many samples of `fb` weigh 0 in every token (`per_sample_loss`: loss and gradient 0): trained on for
    nothing, so left out of the step's count as a damaged one is, not averaged in as a loss of 0."""
    return sum((w.sum() <= 0).float() for w in (fb.weights or []) if w is not None)


def _nonfinite(r: Run, micro: list, step_losses: list[tuple[list[int], torch.Tensor]]) -> None:
    """A step whose loss or gradients are not finite, on every rank: train.on_nonfinite=stop raises naming its
    samples; skip_step records it as skipped (no update; the step still counts, so the schedule and the data
    order go on)."""
    per_sample = step_sample_losses(r, micro, step_losses)
    message = guard.nonfinite_message(r.step + 1, per_sample, r.tables.store_root)
    if r.cfg.on_nonfinite == "stop":
        raise guard.NonFiniteError(message)
    if r.main:
        r.bar.write("skipped " + message.split(";")[0])
    r.result.skipped_steps.append(r.step + 1)
    skipped = [*train_state.nonfinite_skipped(replace(r.record, step=r.step)), r.step + 1]
    r.record = replace(r.record, extra={**r.record.extra, train_state.NONFINITE_SKIPPED: skipped})


def log(r: Run, s: StepStats) -> None:
    """The step's figures: the step's own, except train/loss and the bar's loss, the mean since the last log
    point (as HF Trainer logs it): with `log_every` N one step's loss of every N was a sparse sample of a noisy
    curve. The trackers get them every N steps and at the run's last step (`log_point`)."""
    r.result.losses.append(s.loss)
    r.result.step_epochs.append(s.epoch)
    r.step_tokens.append(tuple(r.step_running_tokens))  # its micro-batches' (`_count_epoch_tokens`)
    r.step_running_tokens = [0, 0]
    del r.step_tokens[:-max(r.cfg.log_every, train_state.KEPT_LOSSES)]  # what a checkpoint keeps, at most
    _log_ended_epochs(r)
    if r.profiler is not None:
        r.profiler.step()
    if r.step % r.cfg.log_every == 0 or r.step == r.cfg.max_steps:  # max_steps off the cadence: its curve's end
        log_point(r, s)
    r.bar.set_postfix(loss=f"{since_log_point(r):.4f}", lr=f"{s.lr:.2e}")
    r.bar.update(1)
    r.result.step_times.append(time.perf_counter() - s.started)  # with logging, without checkpoint writing
    r.result.step_cpu_times.append(time.process_time() - s.cpu_started)
    r.result.step_data_times.append(s.data_seconds)


def since_log_point(r: Run) -> float:
    """train/loss at this step: the mean of the step losses since the last multiple of `log_every` (a checkpoint
    keeps them: the window may begin before a resume). Only the multiples begin a window: a point off the cadence
    (the last step, a stop's) leaves the ones after a resume the straight run's."""
    return recent_mean_loss(r.logged_losses(_since_log_steps(r)))


def _since_log_steps(r: Run) -> int:
    """How many steps train/loss's window at this step holds: those since the last multiple of `log_every`."""
    return r.step - (r.step - 1) // r.cfg.log_every * r.cfg.log_every


def window_padding(r: Run) -> float:
    """train/padding_efficiency at this step: valid / computed tokens of the steps of train/loss's window (a
    checkpoint keeps them). It was the log point's step alone, a sparse sample: with log_every 3 on a 3-step
    epoch it said 0.955 where epoch/padding_efficiency, at the same step and of the same steps, said 0.884."""
    window = r.step_tokens[-_since_log_steps(r):]
    computed = sum(c for _, c in window)
    return sum(v for v, _ in window) / computed if computed else 1.0


def log_point(r: Run, s: StepStats) -> None:
    """The trackers' scalars of step `s` (main process; once a step: a stop's point may be the cadence's)."""
    if r.writer is None or r.logged_step == r.step:
        return
    from stages.train.trackers import peak_memory_gb

    r.logged_step = r.step
    r.writer.log({"train/loss": since_log_point(r), "train/lr": s.lr, "train/grad_norm": s.grad_norm,
                  "train/padding_efficiency": window_padding(r), "train/samples_per_s": s.samples / s.seconds,
                  "train/data_wait_share": s.data_seconds / s.seconds,
                  "train/peak_memory_gb": peak_memory_gb(r.device)}, r.step)


def check_sampling(tc: TrainConfig, model: str) -> None:
    """`train.sample_steps` against the model's scheduler, where sample grids are made
    (`models.loading.check_sampling_steps`; `pipeline run all` asks before its first stage)."""
    if tc.sample_every is not None:
        from models.loading import check_sampling_steps

        check_sampling_steps(tc.sample_steps, "train.sample_steps", model)


def recent_mean_loss(losses, n: int | None = None) -> float:
    """Mean of the last `n` step losses (all when None), the non-finite ones left out (a step with no intact
    sample is nan, a skipped step's loss non-finite: they are reported as skipped, and one would make the whole
    window nan); the last step's loss when none is finite."""
    recent = losses[-n:] if n is not None else losses
    finite = [v for v in recent if math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else recent[-1]


# ---------------------------------------------------------------------------------------------- step pieces


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.mixed_precision != "bf16":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

def backward_of(model, fb: FlowBatch, tc: TrainConfig, device: torch.device, scale: float) -> torch.Tensor:
    """Flow loss of a prepared micro-batch, backward of `scale` x its sum; the detached per-sample losses [B]."""
    with _autocast(tc, device):
        per_sample = flow_loss_of(model, fb)
    (per_sample.sum() * scale).backward()
    return per_sample.detach()


def _count_epoch_tokens(r: Run, m) -> None:
    """Valid / computed tokens of micro-batch `m` (all ranks' micro-batches as they run, `MicroBatches.as_run`,
    from the sampler's lengths), added to its epoch's, reported when it ends, and to its step's (`log`)."""
    valid, computed = padded_tokens(r.batches.as_run(m.global_batch), r.tables.lengths)
    for pair in (r.epoch_tokens, r.step_running_tokens):
        pair[0] += valid
        pair[1] += computed
    if not m.ends_epoch:
        return
    eff = r.epoch_tokens[0] / r.epoch_tokens[1]
    r.result.epoch_padding[m.epoch] = eff
    if r.writer is not None:  # logged at the step's end (`_log_ended_epochs`)
        r.ended_tokens = [a + b for a, b in zip(r.ended_tokens, r.epoch_tokens)]
        r.ended_lines.append(f"epoch {m.epoch}: padding efficiency {eff:.3f} (valid / computed tokens)")
    r.epoch_tokens = [0, 0]


def _log_ended_epochs(r: Run) -> None:
    """epoch/padding_efficiency at the step an epoch ended in, once a step: with epochs shorter than a step (a tiny
    split, grad_accum) several end in one, and each was a point of its own at the same step (0.962 and 0.785 at
    step 2: which epoch's, a reader cannot tell); now one, of their tokens together. Their lines are said here
    too, once the step completed (a step a stop dropped is run again, and said, by the resume)."""
    for line in r.ended_lines:
        r.bar.write(line)
    r.ended_lines.clear()
    if r.writer is None or not r.ended_tokens[1]:
        return
    r.writer.add_scalar("epoch/padding_efficiency", r.ended_tokens[0] / r.ended_tokens[1], r.step)
    r.ended_tokens = [0, 0]


def step_sample_losses(r: Run, micro: list, mine: list[tuple[list[int], torch.Tensor]]) -> dict[str, float]:
    """Every sample's loss of the step by key, the same on every rank (only for a non-finite step): each rank
    fills in its own samples' slots of the step's plan (every rank knows every rank's batch), one all-reduce sums
    them. A rank's own losses alone would name its own samples, on the rank that holds none of the bad ones its
    innocent ones, and each rank a different line."""
    slots = [i for m in micro for share in m.global_batch for i in share]
    table = torch.zeros(2, len(slots), dtype=torch.float64)  # loss, trained (a damaged sample left out: 0)
    offset, own = 0, iter(mine)
    for m in micro:
        for q, share in enumerate(m.global_batch):
            if q == r.rank:
                rows, losses = next(own)
                at = {i: offset + j for j, i in enumerate(share)}
                for i, loss in zip(rows, losses.double().cpu().tolist()):
                    table[:, at[i]] = torch.tensor([loss, 1.0], dtype=torch.float64)
            offset += len(share)
    table = parallel.sum_over_ranks(table.to(r.device), r.world).cpu()
    return {r.tables.keys[i]: loss for i, (loss, trained) in zip(slots, table.T.tolist()) if trained}


def _rescale(params: list[torch.nn.Parameter], factor: torch.Tensor) -> None:
    """Gradients times `factor` (a device scalar: no host sync)."""
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor.to(p.grad.device, p.grad.dtype))


def _clip(params: list[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """The gradients' total norm (clipped to `max_norm` when set), on the device: read with the step's loss."""
    if max_norm is None:
        grads = [p.grad for p in params if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return torch.nn.utils.clip_grad_norm_(params, max_norm)
