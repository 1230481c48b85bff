"""`train` stage: `text` + `vae` tables -> a LoRA run directory (DESIGN §6), as a recipe.

    run = setup(...)               check config, open inputs and run folder, build model + optimizer, resume
    while run.step < max_steps:
        stats = step(run)          grad_accum micro-batches: flow matching on mixed-resolution batches
        log(run, stats)            TensorBoard scalars, progress bar
        checkpoint(run)            every checkpoint_every steps and at the end
    finish(run)                    the final LoRA

Each is a small function over `Run`, the recipe's state. Only the transformer is loaded, never the text encoder
or the VAE: the store already holds their outputs.

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
dropout come from (seed, optimizer step, key), so 1 process and N processes train the same LoRA, and so do
batch B x grad_accum A and batch B*A when the sampler puts the same samples in the step. The global torch
RNG (saved per rank in checkpoints) only feeds LoRA dropout, which is therefore not layout-independent.
The sampler's global steps are planned for the run's first world size, so a resume on another process count
splits the same steps over its ranks and trains the same LoRA (`stages/train/elastic.py`).
Note: after a mid-epoch resume, that epoch's padding efficiency counts from the resume point.
"""

from __future__ import annotations

import time
import warnings
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from features.open import open_configured
from models.collective import fails_alone, together
from models.flow import FlowBatch, flow_loss_of
from models.lora import WEIGHT_NAME, add_lora, load_lora, lora_parameters, save_lora
from models.attention import use_attention_backend
from models.multires import install_multires
from schemas import up_to_date as current
from schemas.config import PipelineConfig, TrainConfig, dump_config
from schemas.errors import UserError
from schemas.lineage import section_fingerprint, unhashed_names
from stages.train import elastic, guard, parallel, previous, state as train_state
from stages.train.budget import make_sampler
from stages.train.damaged import DamagedRows, DamageTally
from stages.train.data import DataStream, write_data_report
from stages.train.launch import launched_world_size, use_cpu
from stages.train.prefetch import MicroBatches
from stages.train.resume import changed_settings
from stages.train.sampler import padding_efficiency
from stages.train.state import ResumeRecord
from stages.train.summary import train_line
from store.format import atomic_dir, atomic_write_bytes, atomic_write_json, pause_point
from store.join import JoinedTables

# What to change when a step runs out of memory (named in the error every rank prints).
OOM_ADVICE = ("lower train.batch_size or train.max_tokens_per_batch, or set train.gradient_checkpointing, "
              "train.offload: blocks or train.quantize_base (`pipeline plan` predicts the peak)")

# Extra torch.compile arguments of `train.compile` (tests use a fast backend).
COMPILE_OPTIONS: dict[str, Any] = {}


@dataclass
class TrainResult:
    run_dir: Path
    lora_dir: Path
    start_step: int  # 0, or the checkpoint step it resumed from
    steps: int  # optimizer steps done in all
    losses: list[float] = field(default_factory=list)  # mean per-sample loss of each step of this start
    step_epochs: list[int] = field(default_factory=list)  # the epoch each of those steps began in
    step_times: list[float] = field(default_factory=list)  # s per optimizer step: data + logging, no checkpoint
    step_cpu_times: list[float] = field(default_factory=list)  # the same in process CPU time (robust to other load)
    epoch_padding: dict[int, float] = field(default_factory=dict)  # epoch -> valid / computed tokens
    skipped_steps: list[int] = field(default_factory=list)  # train.on_nonfinite=skip_step: steps not applied
    main_process: bool = True
    up_to_date: bool = False  # `skip_if_done` found the final LoRA of this very run: nothing trained
    stage: str = "train"
    seconds: float = 0.0
    data: dict = field(default_factory=dict)  # the join's report: samples, dropped, reasons (store.join)
    kept_previous: Path | None = None  # where the run the folder held before this fresh start was kept
    init_lora: str | None = None  # train.init_lora this run started from (not a resume)

    def to_json(self) -> dict:
        from schemas.stage import summary_record

        return summary_record(self.stage, seconds=self.seconds, up_to_date=self.up_to_date, steps=self.steps,
                              start_step=self.start_step, lora=str(self.lora_dir),
                              loss_first=self.losses[0] if self.losses else None,
                              loss_last=self.losses[-1] if self.losses else None, data=self.data,
                              kept_previous=str(self.kept_previous) if self.kept_previous else None)

    def __str__(self) -> str:
        if self.up_to_date:
            return f"LoRA {self.lora_dir} is up to date ({self.steps} steps on the current tables)"
        return train_line(self.start_step, self.steps, self.losses, self.step_epochs, self.lora_dir,
                          init_lora=self.init_lora, skipped=len(self.skipped_steps))


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
    ema: Any = None  # stages.train.ema.AdapterEMA with train.ema_decay
    validator: Any = None  # stages.train.validate.Validator with train.validate_every / sample_every
    profiler: Any = None  # stages.train.trackers.StepProfiler with train.profile
    train_device: torch.device | None = None  # train.device for this rank (None: accelerate's choice)
    new_run: bool = False  # keep the run the folder holds (stages.train.previous) instead of refusing it
    before_keep: Callable[[Path], None] | None = None  # called with RUN just before it is kept (run all: report)
    kept_previous: Path | None = None
    run_lock: Any = None  # the lock of the fresh RUN after a keep (the first one moved with the kept run)
    damage: DamageTally | None = None  # train.on_damaged=skip: samples left out, the agreed limit

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


@dataclass
class StepStats:
    loss: float
    epoch: int  # the epoch the step began in
    samples: int
    grad_norm: float
    batches: list[list[int]]  # every rank's batch of every micro-step (for the padding figure)
    seconds: float  # compute + data, up to the loss sync
    started: float  # perf_counter / process_time at the step's start: `log` adds its own time to the step's
    cpu_started: float


# ---------------------------------------------------------------------------------------------- the recipe


def run(
    cfg: PipelineConfig, store: str | Path, model: str, out: str | Path, resume: bool = False,
    skip_if_done: bool = False, new_run: bool = False, before_keep: Callable[[Path], None] | None = None,
) -> TrainResult:
    """Train (or, with `resume`, continue from OUT's last checkpoint). `skip_if_done`: return at once when OUT
    already holds the final LoRA of a run on the same tables, model and config (`pipeline run all`).
    `new_run`: a run in OUT that cannot be continued (without `resume`: any trained run) is kept as
    OUT.previous/N-TIME (stages/train/previous.py) and training starts afresh; `before_keep(OUT)` runs first."""
    started = time.perf_counter()
    if skip_if_done and up_to_date(cfg, store, model, out):
        lora = Path(out) / "lora"
        return TrainResult(Path(out), lora, cfg.train.max_steps, cfg.train.max_steps, up_to_date=True)
    validate_config(cfg.train)
    from stages.train.trackers import tracker_classes

    tracker_classes(cfg.train.log_with)  # every rank, before any work: an unknown or missing tracker stops all alike
    accelerator = _accelerator(cfg.train)
    # One writer per run folder: a second `train` into the same OUT is refused, naming the holder.
    run_lock = guard.lock_run_dir(Path(out)) if accelerator.is_main_process else None
    locks = [run_lock]
    r = None
    try:
        r = setup(cfg, store, model, out, resume, accelerator, new_run=new_run, before_keep=before_keep, locks=locks)
        while r.step < r.cfg.max_steps:
            stats = step(r)
            log(r, stats)
            if r.validator is not None:
                r.validator(r)
            if r.step % r.cfg.checkpoint_every == 0 or r.step == r.cfg.max_steps:
                checkpoint(r)
        result = finish(r)
        result.seconds = time.perf_counter() - started
        return result
    finally:
        cleanup(r, locks)


def setup(cfg: PipelineConfig, store: str | Path, model: str, out: str | Path, resume: bool = False,
          accelerator=None, *, new_run: bool = False, before_keep: Callable[[Path], None] | None = None,
          locks: list | None = None) -> Run:
    """Check the config, open the inputs and the run folder (resume checks before any model is loaded), build
    the model, optimizer and sampler, restore a checkpoint. `locks`: the run folder's lock is appended there
    when a keep (`new_run`) makes a fresh folder."""
    tc = cfg.train
    if accelerator is None:  # `run` makes it first (the run-folder lock needs the process rank)
        validate_config(tc)
        accelerator = _accelerator(tc)
    chosen = train_device(tc, accelerator.local_process_index, accelerator.num_processes)
    device = chosen or accelerator.device
    requested = tc.dtype
    tc = resolve_precision(tc, device)
    cfg = cfg.model_copy(update={"train": tc})  # train_config.yaml records the resolved dtype
    if accelerator.is_main_process:
        from models.precision import describe, resolve_dtype

        tqdm.write(describe("train (frozen base)", resolve_dtype(tc.dtype, device), device, requested)
                   + (", bf16 autocast" if tc.mixed_precision == "bf16" and tc.dtype != "bfloat16" else "")
                   + (f", quantize_base {tc.quantize_base}" if tc.quantize_base != "none" else ""))
    from models.loading import model_fingerprint

    with together(accelerator.num_processes, "opening the store"):  # a rank refused alone stops every rank
        tables = open_configured(tc, "train", store, model, model_fingerprint(model), "train")
    now = ResumeRecord(
        step=0, epoch=0, batch_in_epoch=0, config_fingerprint=config_fingerprint(tc),
        tables=tables.versions(), store=str(Path(tables.store_root).resolve()),
        model_fingerprint=model_fingerprint(model), world_size=accelerator.num_processes,
    )
    r = Run(tc, accelerator, tables, Path(out), now, train_device=chosen, new_run=new_run, before_keep=before_keep)
    try:
        latest, resumed = _resume_point(r, resume, cfg)
    finally:
        if locks is not None:
            locks.append(r.run_lock)
    if r.main:
        r.checkpoints.mkdir(parents=True, exist_ok=True)
        train_state.remove_stale(r.checkpoints)
        atomic_write_bytes(r.run_dir / "train_config.yaml", dump_config(cfg).encode())
        tqdm.write(write_data_report(r.run_dir, tables))
    accelerator.wait_for_everyone()

    r.transformer = setup_transformer(model, tc, r.device)
    if r.main:  # which attention kernel this run uses and why (a failed packed probe's error included)
        from models.attention import attention_record

        atomic_write_json(r.run_dir / "attention.json", attention_record(r.transformer))
    _check_shapes(tables, r.transformer)
    _build_training(r, store, model, latest, resumed)
    r.bar = tqdm(total=tc.max_steps, initial=r.step, desc="train", unit="step", disable=not r.main, dynamic_ncols=True)
    return r


def _build_training(r: Run, store: str | Path, model: str, latest: Path | None, resumed: ResumeRecord | None) -> None:
    """Adapter (fresh, from init_lora, or restored from `latest`), optimizer, EMA, sampler and data stream,
    validator, the DDP wrap, micro-batches, trackers and profiler: everything a step needs."""
    tc = r.cfg
    if tc.init_lora and latest is None:
        from models.lora import init_from_lora, lora_weight_file
        from store.checksum import check_recorded

        check_recorded(lora_weight_file(tc.init_lora))
        init_from_lora(r.transformer, tc.init_lora)
    r.params = lora_parameters(r.transformer)
    r.optimizer, r.scheduler = make_optimizer(r.params, tc)
    if tc.ema_decay is not None:
        from stages.train.ema import AdapterEMA

        r.ema = AdapterEMA(r.params, tc.ema_decay)
    # The order is planned for the run's first world size whatever this start's (stages/train/elastic.py).
    canonical = resumed.canonical if resumed is not None else r.world
    r.record = replace(r.record, canonical_world_size=canonical)
    sampler = make_sampler(r.tables.lengths, tc.batch_size, tc.max_tokens_per_batch, tc.seed, tc.sampler_window, canonical)
    r.stream = DataStream(elastic.on_world(sampler, r.world))
    if latest is not None:
        _restore(r, latest, resumed)
    if tc.validate_every is not None or tc.sample_every is not None:
        from stages.train.validate import Validator

        r.validator = Validator(tc, store, model, r.run_dir)
        if r.main and r.validator.damaged:
            tqdm.write(f"validation: left out {len(r.validator.damaged)} damaged val sample(s) (train.on_damaged="
                       f"skip): {', '.join(sorted(r.validator.damaged))}")
    from models.qwen21_flow import is_qwen21

    if is_qwen21(r.transformer):  # DDP must wrap the module whose forward training calls (models/qwen21_multires.py)
        from models.qwen21_multires import Qwen21Batched

        r.model = parallel.wrap(Qwen21Batched(r.transformer), r.world, tc.lora.target_modules)
    else:
        r.model = parallel.wrap(r.transformer, r.world, tc.lora.target_modules)
    r.position = r.stream.position
    if tables_skip(r.tables):
        r.damage = DamageTally(r.run_dir, r.rank, r.world)
    r.batches = MicroBatches(r.stream, r.tables, tc, r.rank, r.step, r.device, r.transformer.dtype, depth=tc.prefetch)
    r.result = TrainResult(r.run_dir, r.run_dir / "lora", start_step=r.step, steps=r.step, main_process=r.main,
                           data=r.tables.report, kept_previous=r.kept_previous,
                           init_lora=tc.init_lora if tc.init_lora and latest is None else None)
    if r.main:
        from stages.train.trackers import Trackers

        # purge_step drops events a killed run logged after its last checkpoint, so curves do not double back.
        r.writer = Trackers(tc.log_with, r.run_dir, {"train": tc.model_dump(mode="json")},
                            purge_step=r.step + 1 if r.step else None)
    if tc.profile and tc.max_steps > r.step:
        from stages.train.trackers import StepProfiler

        r.profiler = StepProfiler(min(tc.profile, tc.max_steps - r.step), r.run_dir, r.rank, r.device)


def step(r: Run) -> StepStats:
    """One optimizer step: grad_accum global micro-batches, this rank's share of each (DDP all-reduces the
    gradients during the last backward), then the update.

    Collectives per step: DDP's gradient all-reduce and the loss sum, nothing else; one host sync (the loss,
    the finite check and the gradient norm read together). This rank's data, forward and backward run in
    `fails_alone`: the others may be in DDP's all-reduce, so a failure here (a damaged sample, out of memory)
    is published to every rank instead of agreed on (models/collective.py)."""
    tc, t0, c0 = r.cfg, time.perf_counter(), time.process_time()
    step_losses: list[tuple[list[str], torch.Tensor]] = []  # this rank's, named in a non-finite error
    loss_sum = torch.zeros((), device=r.device)
    damaged = 0  # train.on_damaged=skip: this rank's planned samples left out as damaged (stages/train/damaged.py)
    with fails_alone(r.world, f"optimizer step {r.step + 1}", OOM_ADVICE):
        micro = [r.batches.next() for _ in range(tc.grad_accum)]
        n_step = sum(len(b) for m in micro for b in m.global_batch)
        for k, m in enumerate(micro):
            with parallel.accumulating(r.model, last=k == len(micro) - 1):
                losses = backward_of(r.model, m.flow, tc, r.device, scale=r.world / n_step)
            loss_sum += losses.sum()
            share = [i for i in m.global_batch[r.rank] if i not in m.damaged]
            step_losses.append(([r.tables.keys[i] for i in share], losses))
            _count_epoch_tokens(r, m.epoch, m.global_batch, m.ends_epoch)
            r.position = m.position
            if m.damaged:
                damaged += len(m.damaged)
                r.damage.record(r.tables, m.damaged, r.step + 1)
    if r.damage is None:
        loss_sum = parallel.sum_over_ranks(loss_sum, r.world)
        left_out = torch.zeros((), device=loss_sum.device)
    else:  # the damaged count rides on the loss all-reduce; DDP averaged with the planned count: rescaled
        summed = parallel.sum_over_ranks(torch.stack([loss_sum, torch.tensor(float(damaged), device=r.device)]),
                                         r.world)
        loss_sum, left_out = summed[0], summed[1]
        _rescale(r.params, n_step / (n_step - left_out).clamp(min=1))  # exactly 1.0 when none was left out
    # gradients all-reduced by DDP, the loss here: every rank decides alike. Clipping a non-finite step's
    # gradients does no harm: they are dropped below.
    finite = guard.finite(loss_sum, r.params)
    norm = _clip(r.params, tc.max_grad_norm)
    figures = [t.float().to(loss_sum.device) for t in (loss_sum, finite, norm, left_out)]
    total, ok, grad_norm, left_out = torch.stack(figures).tolist()  # the step's one host sync
    intact = n_step - int(left_out)
    if r.damage is not None:
        r.damage.add(r.tables, int(left_out), n_step)  # over the limit: the same error on every rank, now
    if intact == 0:  # every sample of the step damaged: no update (the step counts, as a skipped one)
        r.bar.write(f"optimizer step {r.step + 1}: every sample damaged, no update")
        r.result.skipped_steps.append(r.step + 1)
        ok, grad_norm = False, float("nan")
    elif ok:
        r.optimizer.step()
    else:
        per_sample = {k: v for keys, losses in step_losses for k, v in zip(keys, losses.tolist())}
        message = guard.nonfinite_message(r.step + 1, per_sample, r.tables.store_root)
        if tc.on_nonfinite == "stop":
            raise guard.NonFiniteError(message)
        # skip_step: no update; the step still counts, so the schedule and the data order go on
        r.bar.write("skipped " + message.split(";")[0])
        r.result.skipped_steps.append(r.step + 1)
        grad_norm = float("nan")
    r.scheduler.step()
    if r.ema is not None:
        r.ema.update()
    r.optimizer.zero_grad(set_to_none=True)
    r.step += 1
    loss = total / intact if intact else float("nan")
    batches = [b for m in micro for b in m.global_batch]
    return StepStats(loss, micro[0].epoch, intact, grad_norm, batches, time.perf_counter() - t0, t0, c0)


def log(r: Run, s: StepStats) -> None:
    r.result.losses.append(s.loss)
    r.result.step_epochs.append(s.epoch)
    lr = r.scheduler.get_last_lr()[0]
    if r.profiler is not None:
        r.profiler.step()
    if r.writer is not None and r.step % r.cfg.log_every == 0:
        from stages.train.trackers import peak_memory_gb

        lin, _ = padding_efficiency(s.batches, r.tables.lengths)
        r.writer.log({"train/loss": s.loss, "train/lr": lr, "train/grad_norm": s.grad_norm,
                      "train/padding_efficiency": lin, "train/samples_per_s": s.samples / s.seconds,
                      "train/peak_memory_gb": peak_memory_gb(r.device)}, r.step)
    r.bar.set_postfix(loss=f"{s.loss:.4f}", lr=f"{lr:.2e}")
    r.bar.update(1)
    r.result.step_times.append(time.perf_counter() - s.started)  # with logging, without checkpoint writing
    r.result.step_cpu_times.append(time.process_time() - s.cpu_started)


def checkpoint(r: Run) -> None:
    """Every rank adds its RNG state; rank 0 writes the rest, the resume record last, and commits the folder
    (rename) once all are in. Each part is agreed on by all ranks (models/collective.py, also the barriers):
    a full disk on rank 0 stops every rank with rank 0's one line, instead of the others waiting for it."""
    epoch, batch = r.position
    record = replace(r.record, step=r.step, epoch=epoch, batch_in_epoch=batch)
    acc, tmp = r.accelerator, train_state.temp_dir(r.checkpoints, r.step)
    final = train_state.checkpoint_dir(r.checkpoints, r.step)
    what = f"checkpoint step-{r.step}"

    def step_of_all(part: str):
        return together(r.world, f"{what} ({part})")

    with ExitStack() as folder:  # rank 0's temp folder: committed by `folder.close()`, removed on an error
        with step_of_all("temp folder"), guard.one_line_errors(what, r.checkpoints):
            if r.main:
                guard.check_lora_finite(r.params, final)
                folder.enter_context(atomic_dir(final, tmp))
        with step_of_all("RNG state"), guard.one_line_errors(what, r.checkpoints):
            train_state.save_rng(tmp, acc.process_index)
        with step_of_all("write"), guard.one_line_errors(what, r.checkpoints):
            if r.main:
                save_lora(r.transformer, tmp / "lora", base_fingerprint=r.record.model_fingerprint)
                train_state.save_optimizer(r.optimizer, tmp)
                train_state.save_scheduler(r.scheduler, tmp)
                if r.ema is not None:
                    r.ema.save(tmp)
                train_state.write_record(tmp, record)
                folder.close()  # fsync + rename: the checkpoint is committed
                train_state.prune(r.checkpoints, r.cfg.keep_checkpoints)
    pause_point("train_after_checkpoint")


def finish(r: Run) -> TrainResult:
    """The final LoRA (written into a temp folder, then swapped in, like a checkpoint)."""
    r.bar.close()
    r.batches.close()
    r.result.steps = r.step
    with together(r.world, "the final LoRA"):  # rank 0 writes; every rank learns whether it could
        if r.main:
            guard.check_lora_finite(r.params, r.result.lora_dir)
            with guard.one_line_errors("the final LoRA", r.run_dir), \
                    atomic_dir(r.result.lora_dir, r.run_dir / ".lora.tmp") as tmp:
                _save_final_lora(r, tmp)
            if r.ema is not None:
                with guard.one_line_errors("the EMA LoRA", r.run_dir), \
                        atomic_dir(r.run_dir / "lora_ema", r.run_dir / ".lora_ema.tmp") as tmp, r.ema.swapped_in():
                    _save_final_lora(r, tmp)
            r.writer.close()
            tqdm.write(f"LoRA after {r.step} steps: {r.result.lora_dir}")
            if r.damage is not None and r.damage.damaged:
                tqdm.write(f"left out {r.damage.damaged} damaged sample read(s) of {r.damage.read} "
                           f"(train.on_damaged=skip), listed in {r.run_dir / guard.DAMAGED_REPORT}")
    return r.result


def _save_final_lora(r: Run, folder: Path) -> None:
    """The LoRA users load elsewhere: alpha folded in (every loader applies the same weights), the base model's
    fingerprint in its metadata, and a sealed checksum record that every later load checks."""
    from store.checksum import write_folder_record

    save_lora(r.transformer, folder, fold_alpha=True, base_fingerprint=r.record.model_fingerprint)
    write_folder_record(folder)


def cleanup(r: Run | None, locks: list) -> None:
    """The last phase, after a finished run or an error (torchtune's recipes end the same way): whatever setup
    opened is closed - the micro-batch stream and its reader thread, the readers' shard descriptors and
    check-ahead threads, the read lease (gc may take the versions now), the TensorBoard writer, the progress bar
    and the run folder's locks - so a process that goes on (`pipeline run all`, tests) holds no descriptor of
    this run. Every step here is idempotent (`finish` closed some of them already)."""
    if r is not None:
        if r.batches is not None:
            r.batches.close()
        if r.bar is not None:
            r.bar.close()
        if r.writer is not None:
            r.writer.close()
        r.tables.close()
    for lock in locks:
        if lock is not None:
            lock.release()


def up_to_date(cfg: PipelineConfig, store: str | Path, model: str, out: str | Path) -> bool:
    """OUT/lora is the final LoRA of a run on the same tables, model and train config, trained to max_steps
    (`schemas.up_to_date`: the last checkpoint's record against `run_inputs`)."""
    weights = Path(out) / "lora" / WEIGHT_NAME
    latest = train_state.latest_checkpoint(Path(out) / "checkpoints")
    if not weights.is_file() or latest is None:
        return False
    # a LoRA older than the last checkpoint is a previous run's (killed before its final save)
    if weights.stat().st_mtime < (latest / train_state.RESUME_JSON).stat().st_mtime:
        return False
    record = ResumeRecord.read(latest / train_state.RESUME_JSON)
    return current.is_current({"step": record.step, **record.inputs()}, run_inputs(cfg, store, model))


def run_inputs(cfg: PipelineConfig, store: str | Path, model: str) -> dict[str, Any]:
    """What a finished run of `cfg` records: its last step, config fingerprint, table versions and model."""
    from models.loading import model_fingerprint

    tables = open_configured(cfg.train, "train", store, model, model_fingerprint(model), "train")  # as training does
    tables.close()  # only its versions are compared
    return {
        "step": cfg.train.max_steps,
        # the run records its resolved precision (dtype auto -> float32 / bfloat16 for its device)
        "config_fingerprint": config_fingerprint(resolve_precision(cfg.train, planned_device(cfg.train))),
        "tables": tables.versions(),
        "model_fingerprint": model_fingerprint(model),
    }


# ---------------------------------------------------------------------------------------------- config


def validate_config(cfg: TrainConfig) -> None:
    if cfg.mixed_precision == "fp16":
        raise UserError("train.mixed_precision 'fp16' is not supported (no loss scaling here); use 'bf16' or 'no'")
    if cfg.warmup_steps > cfg.max_steps:
        raise UserError(f"train.warmup_steps ({cfg.warmup_steps}) exceeds train.max_steps ({cfg.max_steps})")


def config_fingerprint(cfg: TrainConfig) -> str:
    """What determines the trained weights, as declared in schemas/config.py (a resume may change the rest)."""
    return section_fingerprint(cfg)


#: train.lr_schedule -> the name of diffusers' schedule (`diffusers.optimization.get_scheduler`) with that shape
LIBRARY_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def lr_schedule(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of the base LR per optimizer step (0-based): diffusers' schedule of `train.lr_schedule` with
    linear warm-up. The warm-up is read one step ahead, so the first step trains at 1/warmup_steps of the LR,
    not at 0 (a step at LR 0 would do nothing); from the end of the warm-up on it is the library's, step for step."""
    from diffusers.optimization import get_scheduler

    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # get_scheduler wants an optimizer
    library = get_scheduler(LIBRARY_SCHEDULES[cfg.lr_schedule], probe, num_warmup_steps=cfg.warmup_steps,
                            num_training_steps=cfg.max_steps).lr_lambdas[0]
    warmup = cfg.warmup_steps
    return lambda step: library(step + 1 if step < warmup else step)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the base LR for optimizer step `step` (0-based): `lr_schedule(cfg)` at that step."""
    return lr_schedule(cfg)(step)


# ---------------------------------------------------------------------------------------------- setup pieces


def _accelerator(cfg: TrainConfig):
    from accelerate import Accelerator

    from models.loading import check_device
    from models.precision import device_for_rank, first_device

    if cfg.device is not None:  # a requested GPU that is not there is an error, not a silent CPU run
        check_device(device_for_rank(cfg.device, what="train.device"), "train.device")
    # Mixed precision is applied with torch.autocast below, not by accelerate, so that several runs in one
    # process (tests, notebooks) never fight over accelerate's process-wide state.
    accelerator = Accelerator(cpu=use_cpu(first_device(cfg.device)))
    launched = launched_world_size()
    if accelerator.num_processes != launched:  # never N independent single-process runs into one folder
        raise UserError(
            f"launched as {launched} processes but accelerate set up {accelerator.num_processes} "
            f"({accelerator.distributed_type}); set train.device (e.g. --device cpu) or fix the launch"
        )
    if cfg.device is None and launched > 1 and accelerator.device.type == "cpu" and accelerator.is_main_process:
        tqdm.write(f"no GPU: the {launched} processes train on the CPU (gloo); set train.device to choose")
    return accelerator


def train_device(cfg: TrainConfig, local_rank: int, world_size: int) -> torch.device | None:
    """This rank's device from `train.device` (cuda:N, a per-rank list, or cuda = cuda:LOCAL_RANK); None =
    accelerate's choice. A set GPU index becomes the current CUDA device, so NCCL and `cuda` tensors use it
    (accelerate alone would put a single process on cuda:0 whatever was asked)."""
    from models.loading import check_device
    from models.precision import device_for_rank

    if cfg.device is None:
        return None
    dev = check_device(device_for_rank(cfg.device, local_rank, world_size, "train.device"), "train.device")
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    return dev


def planned_device(cfg: TrainConfig) -> torch.device:
    """The device a single-process run of `cfg` would use, without starting accelerate (for up-to-date checks)."""
    from models.precision import device_for_rank

    if cfg.device is not None:
        return torch.device(device_for_rank(cfg.device, what="train.device"))
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_precision(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """The config with the precision `models.precision.resolve_precision` decides for `device`: `train.dtype`
    is the frozen base's dtype (what loads and is recorded), `mixed_precision` the autocast around it."""
    from models.precision import resolve_precision as resolve

    if cfg.dtype == "float16":
        raise UserError("train.dtype float16 is not supported (no loss scaling here); use bfloat16, float32 or auto")
    precision = resolve(cfg.dtype, device, cfg.mixed_precision, what="train.dtype")
    update: dict[str, Any] = {"dtype": precision.weights, "mixed_precision": "bf16" if precision.autocast_bf16 else "no"}
    if cfg.offload == "blocks" and not cfg.gradient_checkpointing:
        # Offloaded weights are fetched again for the backward's recompute; without checkpointing autograd
        # would hold every block's device copy until the backward (no memory saved).
        tqdm.write("train.offload blocks: gradient checkpointing turned on")
        update["gradient_checkpointing"] = True
    return cfg.model_copy(update=update)


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.mixed_precision != "bf16":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _resume_point(r: Run, resume: bool, cfg: PipelineConfig) -> tuple[Path | None, ResumeRecord | None]:
    """The checkpoint to resume from and its record (checked against this start, files checked once), or
    (None, None); refuses to overwrite a run."""
    latest = train_state.latest_checkpoint(r.checkpoints)
    if not resume and r.new_run and previous.holds_trained_run(r.run_dir):
        return _keep_previous(r, "--new-run")
    if latest is not None and not resume:
        raise UserError(f"{r.run_dir} already holds checkpoints ({latest.name}); pass --resume to continue it, "
                        f"--new-run to keep it as {previous.previous_root(r.run_dir)}/N-TIME and train afresh, "
                        "or use a new --out")
    if not resume or latest is None:
        return None, None
    record = ResumeRecord.read(latest / train_state.RESUME_JSON)
    try:
        record.check_matches(r.record, latest)
        if record.step > r.cfg.max_steps:
            raise train_state.ResumeMismatch(
                f"{latest} is already past train.max_steps ({record.step} > {r.cfg.max_steps}): raise max_steps "
                "to continue, or use a new --out for a shorter run",
                reason=f"train.max_steps {record.step} -> {r.cfg.max_steps}")
    except train_state.ResumeMismatch as e:
        ignore = unhashed_names(r.cfg)
        changed = changed_settings(r.run_dir, cfg.model_dump(mode="json"), ignore)
        why = f"{e}\nchanged since {r.run_dir / 'train_config.yaml'}:\n  " + "\n  ".join(changed) if changed else str(e)
        if r.new_run:
            return _keep_previous(r, "; ".join([e.reason, *changed]))
        raise train_state.ResumeMismatch(
            f"{why}\nTo keep this run (moved to {previous.previous_root(r.run_dir)}/N-TIME) and train afresh into "
            f"{r.run_dir}, add --new-run (what `pipeline run all` does)", reason=e.reason) from None
    return latest, record


def _keep_previous(r: Run, why: str) -> tuple[None, None]:
    """Every rank has decided alike (from the same files); once all are past reading the old run, the main
    process moves it aside in one rename and locks the fresh folder."""
    r.accelerator.wait_for_everyone()
    if r.main:
        if r.before_keep is not None:
            r.before_keep(r.run_dir)
        r.kept_previous = previous.keep(r.run_dir)
        r.run_lock = guard.lock_run_dir(r.run_dir)
        tqdm.write(f"kept the previous run of {r.run_dir} (its LoRA and checkpoints) in {r.kept_previous}; "
                   f"training afresh into {r.run_dir} ({why})")
    r.accelerator.wait_for_everyone()
    return None, None


def _restore(r: Run, latest: Path, record: ResumeRecord) -> None:
    load_lora(r.transformer, latest / "lora")
    train_state.load_optimizer(r.optimizer, latest)
    train_state.load_scheduler(r.scheduler, latest)
    elastic.restore_rng(latest, r.rank, record.world_size == r.world, r.cfg.seed, record.step)
    if r.ema is not None:
        r.ema.load(latest)
    r.step = record.step
    r.stream = DataStream(r.stream.sampler, record.epoch, record.batch_in_epoch)
    if r.main:
        tqdm.write(f"resumed from {latest} (step {r.step}, epoch {record.epoch}, batch {record.batch_in_epoch})")
        if record.world_size != r.world:
            tqdm.write(elastic.change_line(record.world_size, r.world, record.canonical))


def setup_transformer(model: str, cfg: TrainConfig, device: torch.device):
    """Frozen base (optionally quantised while loading, optionally offloaded), multires attention, one trainable
    LoRA adapter."""
    from models.loading import load_component
    from models.precision import check_loaded_dtype, dtype_name, resolve_dtype

    base_dtype = resolve_dtype(cfg.dtype, device)  # resolved (resolve_precision): what train_config.yaml records
    # Quantised (models/quantize.py) while loading, straight onto the device: the bf16 base never sits whole
    # in memory when quantize_base is set. With offload the blocks load into host memory and only what stays
    # resident moves to the device.
    load_on = torch.device("cpu") if cfg.offload == "blocks" else device
    transformer = load_component(model, "transformer", dtype=base_dtype, device=load_on, quantize=cfg.quantize_base)
    check_loaded_dtype(transformer, dtype_name(base_dtype), "train.dtype")
    from models.qwen21_flow import is_qwen21

    if is_qwen21(transformer):  # 2.1 mixes layouts with its own forward (models/qwen21_multires.py)
        from models.qwen21_multires import install_qwen21

        install_qwen21(transformer)
    else:
        install_multires(transformer)
    use_attention_backend(transformer, cfg.attention_backend, "train.attention_backend", device, base_dtype)
    transformer.requires_grad_(False)
    if cfg.quantize_base != "none":
        from models.quantize import install_frozen_linear_backward

        install_frozen_linear_backward(transformer)  # saves the quantised, not a dequantised, weight
    torch.manual_seed(cfg.seed)  # LoRA init: the same on every rank
    with warnings.catch_warnings():
        # peft warns that a torchao base cannot merge/unmerge; training never merges (`pipeline lora merge`
        # works on the unquantised base).
        warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated")
        add_lora(transformer, cfg.lora)
    if cfg.gradient_checkpointing or cfg.offload == "blocks":
        transformer.enable_gradient_checkpointing()
    if cfg.compile:  # regional: each block compiled in place (same parameter names); shapes vary per batch
        transformer.compile_repeated_blocks(dynamic=True, **COMPILE_OPTIONS)
    if cfg.offload == "blocks":
        from models.offload import offload_blocks

        offload_blocks(transformer, device, keep=cfg.offload_blocks_on_device)
    else:
        transformer.to(device)
    transformer.train()
    return transformer


def _check_shapes(tables: JoinedTables, transformer) -> None:
    s = DamagedRows(skip=tables_skip(tables)).stand_in(tables, [])  # the first intact sample: a read, not a pass
    if s.slot_mask is not None:  # Qwen-Image-2.1 features
        from models.qwen21_flow import check_shapes_21

        if (problem := check_shapes_21(s, transformer, str(tables.store_root))) is not None:
            raise UserError(problem)
        return
    c4, d = s.target.shape[0] * 4, s.prompt_embeds.shape[1]
    cfg = transformer.config
    if c4 != cfg.in_channels or d != cfg.joint_attention_dim:
        raise UserError(
            f"store {tables.store_root} holds latents with {s.target.shape[0]} channels and text embeds of width {d}, "
            f"but the transformer expects {cfg.in_channels // 4} and {cfg.joint_attention_dim}: wrong --model?"
        )


def make_optimizer(params, cfg: TrainConfig):
    from stages.train.optimizers import build_optimizer

    optimizer = build_optimizer(params, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg))
    return optimizer, scheduler


# ---------------------------------------------------------------------------------------------- step pieces


def backward_of(model, fb: FlowBatch, tc: TrainConfig, device: torch.device, scale: float) -> torch.Tensor:
    """Flow loss of a prepared micro-batch, backward of `scale` x its sum; the detached per-sample losses [B]."""
    with _autocast(tc, device):
        per_sample = flow_loss_of(model, fb)
    (per_sample.sum() * scale).backward()
    return per_sample.detach()


def _count_epoch_tokens(r: Run, epoch: int, global_batch: list[list[int]], ends_epoch: bool) -> None:
    """Valid / computed tokens of the epoch (all ranks, from the sampler's lengths), reported when it ends."""
    lengths = r.tables.lengths
    r.epoch_tokens[0] += sum(lengths[i] for b in global_batch for i in b)
    r.epoch_tokens[1] += sum(max(lengths[i] for i in b) * len(b) for b in global_batch if b)
    if not ends_epoch:
        return
    eff = r.epoch_tokens[0] / r.epoch_tokens[1]
    r.result.epoch_padding[epoch] = eff
    if r.writer is not None:
        r.writer.add_scalar("epoch/padding_efficiency", eff, r.step + 1)
        r.bar.write(f"epoch {epoch}: padding efficiency {eff:.3f} (valid / computed tokens)")
    r.epoch_tokens = [0, 0]


def tables_skip(tables: JoinedTables) -> bool:
    return tables.on_damaged == "skip"


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
