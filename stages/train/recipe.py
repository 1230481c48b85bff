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

Data parallel (accelerate, 1..N processes): each optimizer step takes `grad_accum` global micro-batches from
the length-aware sampler; each rank computes its share, its loss scaled by world_size / (samples in the whole
step), and after the backward passes one all-reduce (mean) of the flattened LoRA gradients gives every rank
the gradient of the mean per-sample loss over the whole step. That is DDP's arithmetic, done by hand because
the multires forward needs the bare module, and the LoRA gradients are small. Per-sample σ, noise and caption
dropout come from (seed, optimizer step, key), so 1 process and N processes train the same LoRA, and so do
batch B x grad_accum A and batch B*A when the sampler puts the same samples in the step. The global torch
RNG (saved per rank in checkpoints) only feeds LoRA dropout, which is therefore not layout-independent.
Note: after a mid-epoch resume, that epoch's padding efficiency counts from the resume point.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from models.flow import flow_loss
from models.lora import WEIGHT_NAME, add_lora, load_lora, lora_parameters, save_lora
from models.multires import install_multires
from models.randomness import draw_caption_dropout, draw_noise, draw_sigma
from schemas.config import PipelineConfig, TrainConfig, dump_config
from schemas.errors import UserError
from stages.train import state as train_state
from stages.train.data import DataStream, load_at, open_inputs, write_data_report
from stages.train.sampler import LengthAwareBatchSampler, padding_efficiency
from stages.train.state import ResumeRecord
from store.format import atomic_dir
from store.join import JoinedTables

# Settings that change how long or how often, not what is trained: a resume may change them.
_NOT_FINGERPRINTED = {"max_steps", "checkpoint_every", "keep_checkpoints", "log_every", "device",
                      "max_dropped_fraction", "max_open_shards"}  # which samples: recorded by the tables


@dataclass
class TrainResult:
    run_dir: Path
    lora_dir: Path
    start_step: int  # 0, or the checkpoint step it resumed from
    steps: int  # optimizer steps done in all
    losses: list[float] = field(default_factory=list)  # mean per-sample loss of each step of this start
    step_times: list[float] = field(default_factory=list)  # s per optimizer step: data + logging, no checkpoint
    step_cpu_times: list[float] = field(default_factory=list)  # the same in process CPU time (robust to other load)
    epoch_padding: dict[int, float] = field(default_factory=dict)  # epoch -> valid / computed tokens
    main_process: bool = True
    up_to_date: bool = False  # `skip_if_done` found the final LoRA of this very run: nothing trained
    stage: str = "train"
    seconds: float = 0.0
    data: dict = field(default_factory=dict)  # the join's report: samples, dropped, reasons (store.join)

    def to_json(self) -> dict:
        from schemas.stage import summary_record

        return summary_record(self.stage, seconds=self.seconds, up_to_date=self.up_to_date, steps=self.steps,
                              start_step=self.start_step, lora=str(self.lora_dir),
                              loss_first=self.losses[0] if self.losses else None,
                              loss_last=self.losses[-1] if self.losses else None, data=self.data)

    def __str__(self) -> str:
        if self.up_to_date:
            return f"LoRA {self.lora_dir} is up to date ({self.steps} steps on the current tables)"
        how = f"resumed at step {self.start_step}" if self.start_step else "from scratch"
        loss = f", train loss {self.losses[0]:.4f} -> {self.losses[-1]:.4f}" if self.losses else ""
        return f"trained {how} to step {self.steps}{loss}; LoRA: {self.lora_dir}"


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
    step: int = 0
    writer: Any = None  # TensorBoard, main process only
    bar: Any = None
    result: TrainResult | None = None
    epoch_tokens: list[int] = field(default_factory=lambda: [0, 0])  # valid, computed of the current epoch

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

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
    samples: int
    grad_norm: float
    batches: list[list[int]]  # every rank's batch of every micro-step (for the padding figure)
    seconds: float  # compute + data, up to the loss sync
    started: float  # perf_counter / process_time at the step's start: `log` adds its own time to the step's
    cpu_started: float


# ---------------------------------------------------------------------------------------------- the recipe


def run(
    cfg: PipelineConfig, store: str | Path, model: str, out: str | Path, resume: bool = False,
    skip_if_done: bool = False,
) -> TrainResult:
    """Train (or, with `resume`, continue from OUT's last checkpoint). `skip_if_done`: return at once when OUT
    already holds the final LoRA of a run on the same tables, model and config (`pipeline run all`)."""
    started = time.perf_counter()
    if skip_if_done and up_to_date(cfg, store, model, out):
        lora = Path(out) / "lora"
        return TrainResult(Path(out), lora, cfg.train.max_steps, cfg.train.max_steps, up_to_date=True)
    r = setup(cfg, store, model, out, resume)
    while r.step < r.cfg.max_steps:
        stats = step(r)
        log(r, stats)
        if r.step % r.cfg.checkpoint_every == 0 or r.step == r.cfg.max_steps:
            checkpoint(r)
    result = finish(r)
    result.seconds = time.perf_counter() - started
    return result


def setup(cfg: PipelineConfig, store: str | Path, model: str, out: str | Path, resume: bool) -> Run:
    """Check the config, open the inputs and the run folder (resume checks before any model is loaded), build
    the model, optimizer and sampler, restore a checkpoint."""
    tc = cfg.train
    validate_config(tc)
    accelerator = _accelerator(tc)
    if tc.mixed_precision == "bf16" and not _bf16_supported(accelerator.device):
        tqdm.write(f"bf16 is not supported on {accelerator.device}: training in float32")
        tc = tc.model_copy(update={"mixed_precision": "no"})
    from models.loading import model_fingerprint

    tables = open_inputs(store, model, "train", tc.max_dropped_fraction, tc.max_open_shards)
    now = ResumeRecord(
        step=0, epoch=0, batch_in_epoch=0, config_fingerprint=config_fingerprint(tc),
        tables=tables.versions(), store=str(Path(tables.store_root).resolve()),
        model_fingerprint=model_fingerprint(model), world_size=accelerator.num_processes,
    )
    r = Run(tc, accelerator, tables, Path(out), now)
    latest = _resume_point(r, resume)
    if r.main:
        r.checkpoints.mkdir(parents=True, exist_ok=True)
        train_state.remove_stale(r.checkpoints)
        (r.run_dir / "train_config.yaml").write_text(dump_config(cfg))
        tqdm.write(write_data_report(r.run_dir, tables))
    accelerator.wait_for_everyone()

    r.transformer = setup_transformer(model, tc, r.device)
    _check_shapes(tables, r.transformer)
    r.params = lora_parameters(r.transformer)
    r.optimizer, r.scheduler = make_optimizer(r.params, tc)
    sampler = LengthAwareBatchSampler(
        tables.lengths, tc.batch_size, seed=tc.seed, window=tc.sampler_window, world_size=r.world
    )
    r.stream = DataStream(sampler)
    if latest is not None:
        _restore(r, latest)
    r.result = TrainResult(r.run_dir, r.run_dir / "lora", start_step=r.step, steps=r.step, main_process=r.main,
                           data=tables.report)
    if r.main:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events a killed run logged after its last checkpoint, so curves do not double back.
        r.writer = SummaryWriter(str(r.run_dir / "logs"), purge_step=r.step + 1 if r.step else None)
    r.bar = tqdm(total=tc.max_steps, initial=r.step, desc="train", unit="step", disable=not r.main, dynamic_ncols=True)
    return r


def step(r: Run) -> StepStats:
    """One optimizer step: grad_accum global micro-batches, this rank's share of each, then all-reduce + update."""
    tc, t0, c0 = r.cfg, time.perf_counter(), time.process_time()
    micro = [r.stream.next() for _ in range(tc.grad_accum)]
    n_step = sum(len(b) for _, global_batch, _ in micro for b in global_batch)
    loss_sum = torch.zeros((), device=r.device)
    for epoch, global_batch, ends_epoch in micro:
        samples = [load_at(r.tables, i) for i in global_batch[r.rank]]
        loss_sum += forward_backward(r.transformer, samples, tc, r.step, r.device, scale=r.world / n_step)
        _count_epoch_tokens(r, epoch, global_batch, ends_epoch)
    loss_sum = _all_reduce_grads(r.params, loss_sum, r.world)
    grad_norm = _clip(r.params, tc.max_grad_norm)
    r.optimizer.step()
    r.scheduler.step()
    r.optimizer.zero_grad(set_to_none=True)
    r.step += 1
    loss = loss_sum.item() / n_step  # the sync point: the step's compute is done here
    batches = [b for _, gb, _ in micro for b in gb]
    return StepStats(loss, n_step, grad_norm, batches, time.perf_counter() - t0, t0, c0)


def log(r: Run, s: StepStats) -> None:
    r.result.losses.append(s.loss)
    lr = r.scheduler.get_last_lr()[0]
    if r.writer is not None and r.step % r.cfg.log_every == 0:
        lin, _ = padding_efficiency(s.batches, r.tables.lengths)
        r.writer.add_scalar("train/loss", s.loss, r.step)
        r.writer.add_scalar("train/lr", lr, r.step)
        r.writer.add_scalar("train/grad_norm", s.grad_norm, r.step)
        r.writer.add_scalar("train/padding_efficiency", lin, r.step)
        r.writer.add_scalar("train/samples_per_s", s.samples / s.seconds, r.step)
    r.bar.set_postfix(loss=f"{s.loss:.4f}", lr=f"{lr:.2e}")
    r.bar.update(1)
    r.result.step_times.append(time.perf_counter() - s.started)  # with logging, without checkpoint writing
    r.result.step_cpu_times.append(time.process_time() - s.cpu_started)


def checkpoint(r: Run) -> None:
    """Every rank adds its RNG state; rank 0 writes the rest, the resume record last, and commits the folder
    (rename) once all are in."""
    epoch, batch = r.stream.position
    record = replace(r.record, step=r.step, epoch=epoch, batch_in_epoch=batch)
    acc, tmp = r.accelerator, train_state.temp_dir(r.checkpoints, r.step)
    final = train_state.checkpoint_dir(r.checkpoints, r.step)
    with atomic_dir(final, tmp) if r.main else nullcontext(tmp):
        acc.wait_for_everyone()  # the temp folder exists
        train_state.save_rng(tmp, acc.process_index)
        acc.wait_for_everyone()
        if r.main:
            save_lora(r.transformer, tmp / "lora")
            train_state.save_optimizer(r.optimizer, tmp)
            train_state.save_scheduler(r.scheduler, tmp)
            train_state.write_record(tmp, record)
    if r.main:
        train_state.prune(r.checkpoints, r.cfg.keep_checkpoints)
    acc.wait_for_everyone()


def finish(r: Run) -> TrainResult:
    """The final LoRA (written into a temp folder, then swapped in, like a checkpoint)."""
    r.bar.close()
    r.result.steps = r.step
    if r.main:
        with atomic_dir(r.result.lora_dir, r.run_dir / ".lora.tmp") as tmp:
            save_lora(r.transformer, tmp)
        r.writer.close()
        tqdm.write(f"LoRA after {r.step} steps: {r.result.lora_dir}")
    r.accelerator.wait_for_everyone()
    return r.result


def up_to_date(cfg: PipelineConfig, store: str | Path, model: str, out: str | Path) -> bool:
    """OUT/lora is the final LoRA of a run on the same tables, model and train config, trained to max_steps."""
    from models.loading import model_fingerprint

    weights = Path(out) / "lora" / WEIGHT_NAME
    latest = train_state.latest_checkpoint(Path(out) / "checkpoints")
    if not weights.is_file() or latest is None:
        return False
    record = ResumeRecord.read(latest / train_state.RESUME_JSON)
    tables = open_inputs(store, model, "train", cfg.train.max_dropped_fraction, cfg.train.max_open_shards)
    return (
        record.step == cfg.train.max_steps
        and record.config_fingerprint == config_fingerprint(cfg.train)
        and record.tables == tables.versions()
        and record.model_fingerprint == model_fingerprint(model)
        # a LoRA older than the last checkpoint is a previous run's (killed before its final save)
        and weights.stat().st_mtime >= (latest / train_state.RESUME_JSON).stat().st_mtime
    )


# ---------------------------------------------------------------------------------------------- config


def validate_config(cfg: TrainConfig) -> None:
    if cfg.mixed_precision == "fp16":
        raise UserError("train.mixed_precision 'fp16' is not supported (no loss scaling here); use 'bf16' or 'no'")
    if cfg.warmup_steps > cfg.max_steps:
        raise UserError(f"train.warmup_steps ({cfg.warmup_steps}) exceeds train.max_steps ({cfg.max_steps})")


def config_fingerprint(cfg: TrainConfig) -> str:
    """What determines the trained weights. max_steps counts only when the LR schedule decays towards it."""
    exclude = set(_NOT_FINGERPRINTED)
    if cfg.lr_schedule != "constant":
        exclude.discard("max_steps")
    blob = json.dumps(cfg.model_dump(mode="json", exclude=exclude), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the base LR for optimizer step `step` (0-based): linear warm-up, then the schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    if cfg.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------- setup pieces


def _accelerator(cfg: TrainConfig):
    from accelerate import Accelerator

    from models.loading import check_device

    if cfg.device is not None:  # a requested GPU that is not there is an error, not a silent CPU run
        check_device(cfg.device, "train.device")
    # Mixed precision is applied with torch.autocast below, not by accelerate, so that several runs in one
    # process (tests, notebooks) never fight over accelerate's process-wide state.
    return Accelerator(cpu=cfg.device == "cpu")


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.mixed_precision != "bf16":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _bf16_supported(device: torch.device) -> bool:
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())


def _resume_point(r: Run, resume: bool) -> Path | None:
    """The checkpoint to resume from (checked against this start), or None; refuses to overwrite a run."""
    latest = train_state.latest_checkpoint(r.checkpoints)
    if latest is not None and not resume:
        raise UserError(f"{r.run_dir} already holds checkpoints ({latest.name}); pass --resume or use a new --out")
    if not resume or latest is None:
        return None
    record = ResumeRecord.read(latest / train_state.RESUME_JSON)
    record.check_matches(r.record, latest)
    if record.step > r.cfg.max_steps:
        raise train_state.ResumeMismatch(
            f"{latest} is already past train.max_steps ({record.step} > {r.cfg.max_steps}): raise max_steps to "
            "continue, or use a new --out for a shorter run"
        )
    return latest


def _restore(r: Run, latest: Path) -> None:
    record = ResumeRecord.read(latest / train_state.RESUME_JSON)
    load_lora(r.transformer, latest / "lora")
    train_state.load_optimizer(r.optimizer, latest)
    train_state.load_scheduler(r.scheduler, latest)
    train_state.load_rng(latest, r.rank)
    r.step = record.step
    r.stream = DataStream(r.stream.sampler, record.epoch, record.batch_in_epoch)
    if r.main:
        tqdm.write(f"resumed from {latest} (step {r.step}, epoch {record.epoch}, batch {record.batch_in_epoch})")


def setup_transformer(model: str, cfg: TrainConfig, device: torch.device):
    """Frozen base (optionally int8 weight-only), multires attention, one trainable LoRA adapter."""
    from models.loading import load_component

    base_dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32
    transformer = load_component(model, "transformer", dtype=base_dtype, device=device)
    install_multires(transformer)
    transformer.requires_grad_(False)
    if cfg.quantize_base == "int8_weight_only":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        # Only the blocks' linears: embeddings in/out stay exact, and they are a tiny share of the weights.
        quantize_(transformer.transformer_blocks, Int8WeightOnlyConfig())
    torch.manual_seed(cfg.seed)  # LoRA init: the same on every rank
    with warnings.catch_warnings():
        # peft warns that a torchao base cannot merge/unmerge; training never merges (`pipeline lora merge`
        # works on the unquantised base).
        warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated")
        add_lora(transformer, cfg.lora)
    if cfg.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    transformer.to(device)
    transformer.train()
    return transformer


def _check_shapes(tables: JoinedTables, transformer) -> None:
    s = load_at(tables, 0)
    c4, d = s.target.shape[0] * 4, s.prompt_embeds.shape[1]
    cfg = transformer.config
    if c4 != cfg.in_channels or d != cfg.joint_attention_dim:
        raise UserError(
            f"store {tables.store_root} holds latents with {s.target.shape[0]} channels and text embeds of width {d}, "
            f"but the transformer expects {cfg.in_channels // 4} and {cfg.joint_attention_dim}: wrong --model?"
        )


def make_optimizer(params, cfg: TrainConfig):
    optimizer = torch.optim.AdamW(
        params, lr=cfg.learning_rate, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
    return optimizer, scheduler


# ---------------------------------------------------------------------------------------------- step pieces


def forward_backward(transformer, samples: list, tc: TrainConfig, step: int, device: torch.device, scale: float):
    """Per-sample σ, noise and caption dropout for this step, the flow loss, backward of `scale` × its sum.
    Returns the detached sum of the per-sample losses."""
    sigmas = torch.stack([draw_sigma(s, tc.seed, step, tc.sigma) for s in samples])
    noises = [draw_noise(s, tc.seed, step) for s in samples]
    empty = [draw_caption_dropout(s, tc.seed, step, tc.caption_dropout) for s in samples]
    weights = (tc.loss.mask_weight.foreground, tc.loss.mask_weight.background)
    with _autocast(tc, device):
        per_sample = flow_loss(transformer, samples, sigmas, noises, use_empty=empty, mask_weight=weights)
    (per_sample.sum() * scale).backward()
    return per_sample.detach().sum()


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


def _all_reduce_grads(params: list[torch.nn.Parameter], loss_sum: torch.Tensor, world: int) -> torch.Tensor:
    """Mean of the LoRA gradients over ranks (one flat all-reduce, the loss sum rides along); returns the
    loss sum over all ranks."""
    if world == 1:
        return loss_sum
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads] + [loss_sum.reshape(1).float()])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = (flat[offset : offset + n] / world).view_as(g).to(g.dtype)
        offset += n
    return flat[-1]


def _clip(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    if max_norm is None:
        grads = [p.grad for p in params if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
