"""`train` stage: `text` + `vae` tables -> a LoRA run directory (DESIGN §6).

Read top to bottom: validate config -> open tables -> set up (transformer, LoRA, optimizer, schedule) ->
resume -> loop (flow matching on mixed-resolution batches) -> final LoRA. Only the transformer is loaded, never
the text encoder or the VAE: the store already holds their outputs.

RUN/
  checkpoints/step-N/   LoRA + optimizer + scheduler + RNG + data position (stages/train_state.py)
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
Notes: after a mid-epoch resume, that epoch's padding efficiency counts from the resume point;
`train.num_workers` is unused (store reads are zero-copy mmap slices, done inline).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from models.loading import model_fingerprint
from models.lora_io import add_lora, load_lora, lora_parameters, save_lora
from models.multires import install_multires
from pipeline.config import PipelineConfig, TrainConfig, dump_config
from schemas.errors import UserError
from stages import train_state
from stages.sampler import LengthAwareBatchSampler, padding_efficiency
from stages.train_data import (
    TrainTables,
    draw_caption_dropout,
    draw_noise,
    draw_sigma,
    flow_loss,
    open_train_tables,
)
from stages.train_state import ResumeRecord
from store import Store

# Settings that change how long or how often, not what is trained: a resume may change them.
_NOT_FINGERPRINTED = {"max_steps", "checkpoint_every", "keep_checkpoints", "log_every", "num_workers", "device"}


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


# ---------------------------------------------------------------------------------------------- setup


def _accelerator(cfg: TrainConfig):
    from accelerate import Accelerator

    from models.loading import check_device

    from models.precision import device_for_rank, first_device

    if cfg.device is not None:  # a requested GPU that is not there is an error, not a silent CPU run
        check_device(device_for_rank(cfg.device, what="train.device"), "train.device")
    # Mixed precision is applied with torch.autocast below, not by accelerate, so that several runs in one
    # process (tests, notebooks) never fight over accelerate's process-wide state.
    return Accelerator(cpu=first_device(cfg.device) == "cpu")


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
    """`train.dtype: auto` made concrete for `device`: bf16 when mixed_precision is bf16 or on a bf16 GPU,
    else float32. A bf16 base computes under bf16 autocast (the LoRA weights stay float32)."""
    from models.precision import bf16_supported, resolve_dtype

    if cfg.mixed_precision == "bf16" and not _bf16_supported(device):
        tqdm.write(f"bf16 is not supported on {device}: training in float32")
        cfg = cfg.model_copy(update={"mixed_precision": "no", "dtype": "float32"})
    if cfg.dtype == "auto":
        name = "bfloat16" if cfg.mixed_precision == "bf16" else str(resolve_dtype("auto", device)).removeprefix("torch.")
    else:
        name = cfg.dtype
    if name == "float16":
        raise UserError("train.dtype float16 is not supported (no loss scaling here); use bfloat16, float32 or auto")
    if name == "bfloat16" and not (_bf16_supported(device) or bf16_supported(device)):
        raise UserError(f"train.dtype bfloat16: {device} has no bf16 support; use float32 or auto")
    update = {"dtype": name}
    if cfg.offload == "blocks" and not cfg.gradient_checkpointing:
        # Offloaded weights are fetched again for the backward's recompute; without checkpointing autograd
        # would hold every block's device copy until the backward (no memory saved).
        tqdm.write("train.offload blocks: gradient checkpointing turned on")
        update["gradient_checkpointing"] = True
    if name == "bfloat16":
        update["mixed_precision"] = "bf16"
    return cfg.model_copy(update=update)


def _autocast(cfg: TrainConfig, device: torch.device):
    if cfg.mixed_precision != "bf16":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _bf16_supported(device: torch.device) -> bool:
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())


def setup_transformer(model: str, cfg: TrainConfig, device: torch.device):
    """Frozen base (optionally int8 weight-only), multires attention, one trainable LoRA adapter."""
    from models.loading import load_component

    from models.precision import resolve_dtype

    base_dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else resolve_dtype(cfg.dtype, device)
    # Quantised (models/quantize.py) while loading, straight onto the device: the bf16 base never sits whole
    # in memory when quantize_base is set.
    # With offload the blocks load into host memory and only what stays resident moves to the device.
    load_on = torch.device("cpu") if cfg.offload == "blocks" else device
    transformer = load_component(model, "transformer", dtype=base_dtype, device=load_on, quantize=cfg.quantize_base)
    install_multires(transformer)
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
    if cfg.offload == "blocks":
        from models.offload import offload_blocks

        offload_blocks(transformer, device, keep=cfg.offload_blocks_on_device)
    else:
        transformer.to(device)
    transformer.train()
    return transformer


def _check_shapes(tables: TrainTables, transformer) -> None:
    s = tables.sample(tables.keys[0])
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


# ---------------------------------------------------------------------------------------------- data position


class DataStream:
    """Endless (epoch, batch) stream over the sampler; `position` is what a checkpoint stores."""

    def __init__(self, sampler: LengthAwareBatchSampler, epoch: int = 0, batch: int = 0):
        self.sampler, self.epoch, self.batch = sampler, epoch, batch
        self._steps: list[list[list[int]]] | None = None

    @property
    def position(self) -> tuple[int, int]:
        return self.epoch, self.batch

    def next(self) -> tuple[int, list[list[int]], bool]:
        """(epoch, every rank's batch of the next global micro-step, whether it ends the epoch)."""
        if self._steps is None:
            self._steps = self.sampler.global_steps(self.epoch)
        epoch, step = self.epoch, self._steps[self.batch]
        self.batch += 1
        last = self.batch == len(self._steps)
        if last:
            self.epoch, self.batch, self._steps = self.epoch + 1, 0, None
        return epoch, step, last


# ---------------------------------------------------------------------------------------------- the stage


def run(
    cfg: PipelineConfig, store: Store | str | Path, model: str, out: str | Path, resume: bool = False
) -> TrainResult:
    tc = cfg.train
    validate_config(tc)
    accelerator = _accelerator(tc)
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    device = train_device(tc, accelerator.local_process_index, world) or device
    main = accelerator.is_main_process
    requested = tc.dtype
    tc = resolve_precision(tc, device)
    cfg = cfg.model_copy(update={"train": tc})  # train_config.yaml records the resolved dtype
    if main:
        from models.precision import describe, resolve_dtype

        tqdm.write(describe("train (frozen base)", resolve_dtype(tc.dtype, device), device, requested)
                   + (f", quantize_base {tc.quantize_base}" if tc.quantize_base != "none" else ""))

    # ---- inputs and run folder
    tables = open_train_tables(store.root if isinstance(store, Store) else store, model, split="train")
    run_dir = Path(out)
    ckpt_root, lora_dir, log_dir = run_dir / "checkpoints", run_dir / "lora", run_dir / "logs"
    now = ResumeRecord(
        step=0, epoch=0, batch_in_epoch=0, config_fingerprint=config_fingerprint(tc),
        tables=tables.versions(), store=str(Path(tables.store_root).resolve()),
        model_fingerprint=model_fingerprint(model), world_size=world,
    )
    latest = train_state.latest_checkpoint(ckpt_root)
    if latest is not None and not resume:
        raise UserError(f"{run_dir} already holds checkpoints ({latest.name}); pass --resume or use a new --out")
    record = None
    if resume and latest is not None:  # checked before any model is loaded: a mismatch fails fast
        record = ResumeRecord.read(latest / train_state.RESUME_JSON)
        record.check_matches(now, latest)
        if record.step > tc.max_steps:
            raise train_state.ResumeMismatch(
                f"{latest} is already past train.max_steps ({record.step} > {tc.max_steps}): raise max_steps to "
                "continue, or use a new --out for a shorter run"
            )
    if main:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        train_state.remove_stale(ckpt_root)
        (run_dir / "train_config.yaml").write_text(dump_config(cfg))
    accelerator.wait_for_everyone()

    # ---- model, optimizer, schedule
    transformer = setup_transformer(model, tc, device)
    _check_shapes(tables, transformer)
    params = lora_parameters(transformer)
    optimizer, scheduler = make_optimizer(params, tc)
    sampler = LengthAwareBatchSampler(
        tables.lengths, tc.batch_size, seed=tc.seed, window=tc.sampler_window, rank=rank, world_size=world
    )

    # ---- resume
    step, stream = 0, DataStream(sampler)
    if record is not None and latest is not None:
        load_lora(transformer, latest / "lora")
        train_state.load_optimizer(optimizer, latest)
        train_state.load_scheduler(scheduler, latest)
        train_state.load_rng(latest, rank)
        step = record.step
        stream = DataStream(sampler, record.epoch, record.batch_in_epoch)
        if main:
            tqdm.write(f"resumed from {latest} (step {step}, epoch {record.epoch}, batch {record.batch_in_epoch})")
    result = TrainResult(run_dir, lora_dir, start_step=step, steps=step, main_process=main)

    writer = None
    if main:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events a killed run logged after its last checkpoint, so curves do not double back.
        writer = SummaryWriter(str(log_dir), purge_step=step + 1 if step else None)

    # ---- loop
    epoch_tokens = [0, 0]  # valid, computed of the current epoch (all ranks, from the sampler's lengths)
    bar = tqdm(total=tc.max_steps, initial=step, desc="train", unit="step", disable=not main, dynamic_ncols=True)
    while step < tc.max_steps:
        t0, c0 = time.perf_counter(), time.process_time()
        micro = [stream.next() for _ in range(tc.grad_accum)]
        n_step = sum(len(b) for _, global_batch, _ in micro for b in global_batch)
        loss_sum = torch.zeros((), device=device)
        for epoch, global_batch, ends_epoch in micro:
            samples = [tables.sample(tables.keys[i]) for i in global_batch[rank]]
            loss_sum += forward_backward(transformer, samples, tc, step, device, scale=world / n_step)
            valid, computed = _tokens(global_batch, tables.lengths)
            epoch_tokens[0] += valid
            epoch_tokens[1] += computed
            if ends_epoch:
                eff = epoch_tokens[0] / epoch_tokens[1]
                result.epoch_padding[epoch] = eff
                if writer is not None:
                    writer.add_scalar("epoch/padding_efficiency", eff, step + 1)
                    bar.write(f"epoch {epoch}: padding efficiency {eff:.3f} (valid / computed tokens)")
                epoch_tokens = [0, 0]

        loss_sum = _all_reduce_grads(params, loss_sum, world)
        grad_norm = _clip(params, tc.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        loss = loss_sum.item() / n_step  # the sync point: the step's compute is done here
        dt = time.perf_counter() - t0
        result.losses.append(loss)
        if writer is not None and step % tc.log_every == 0:
            lin, _ = padding_efficiency([b for _, gb, _ in micro for b in gb], tables.lengths)
            writer.add_scalar("train/loss", loss, step)
            writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)
            writer.add_scalar("train/grad_norm", grad_norm, step)
            writer.add_scalar("train/padding_efficiency", lin, step)
            writer.add_scalar("train/samples_per_s", n_step / dt, step)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
        bar.update(1)
        result.step_times.append(time.perf_counter() - t0)  # with logging, without checkpoint writing
        result.step_cpu_times.append(time.process_time() - c0)

        if step % tc.checkpoint_every == 0 or step == tc.max_steps:
            epoch, batch = stream.position
            record = replace(now, step=step, epoch=epoch, batch_in_epoch=batch)
            save_checkpoint(accelerator, transformer, optimizer, scheduler, ckpt_root, record, tc.keep_checkpoints)
    bar.close()
    result.steps = step

    # ---- final LoRA (temp folder + rename, like a checkpoint)
    if main:
        tmp = run_dir / ".lora.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_lora(transformer, tmp)
        if lora_dir.exists():
            shutil.rmtree(lora_dir)
        os.rename(tmp, lora_dir)
        writer.close()
        tqdm.write(f"LoRA after {step} steps: {lora_dir}")
    accelerator.wait_for_everyone()
    return result


# ---------------------------------------------------------------------------------------------- loop pieces


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


def _tokens(global_batch: list[list[int]], lengths: list[int]) -> tuple[int, int]:
    valid = sum(lengths[i] for b in global_batch for i in b)
    computed = sum(max(lengths[i] for i in b) * len(b) for b in global_batch if b)
    return valid, computed


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


def save_checkpoint(accelerator, transformer, optimizer, scheduler, root: Path, record: ResumeRecord, keep: int) -> None:
    """Every rank adds its RNG state; rank 0 writes the rest and commits (rename) once all are in."""
    tmp = None
    if accelerator.is_main_process:
        tmp = train_state.begin(root, record.step)
    accelerator.wait_for_everyone()
    train_state.save_rng(train_state.temp_dir(root, record.step), accelerator.process_index)
    accelerator.wait_for_everyone()
    if tmp is not None:
        save_lora(transformer, tmp / "lora")
        train_state.save_optimizer(optimizer, tmp)
        train_state.save_scheduler(scheduler, tmp)
        train_state.commit(root, record.step, tmp, record)
        train_state.prune(root, keep)
    accelerator.wait_for_everyone()
