"""What a step needs, built once per start: the transformer (frozen base, multires attention, one LoRA adapter),
its shape check against the store, then adapter weights, optimizer, EMA, sampler, data stream, validator, the
DDP wrap, micro-batches, trackers and profiler."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from models.attention import use_attention_backend
from models.collective import together
from models.lora import add_lora, lora_parameters
from models.multires import install_multires
from schemas.config import TrainConfig
from schemas.errors import UserError
from stages.train import elastic, parallel, state as train_state
from stages.train.budget import PLAN_SHUFFLE, make_sampler
from stages.train.damaged import DamagedRows, DamageTally, tables_skip
from stages.train.data import DataStream
from stages.train.prefetch import MicroBatches
from stages.train.result import TrainResult
from stages.train.schedule import make_optimizer
from stages.train.start import restore
from stages.train.state import ResumeRecord
from store.join import JoinedTables

if TYPE_CHECKING:
    from stages.train.recipe import Run

# Extra torch.compile arguments of `train.compile` (tests use a fast backend).
COMPILE_OPTIONS: dict[str, Any] = {}


def setup_transformer(model: str, cfg: TrainConfig, device: torch.device, world: int = 1):
    """Frozen base (optionally quantised while loading, optionally offloaded), multires attention, one trainable
    LoRA adapter. With several ranks (`world`) every rank calls it: the attention backend is one decision of all
    ranks (models/attention.py `agree`)."""
    from models.loading import load_component
    from models.precision import check_loaded_dtype, dtype_name, resolve_dtype

    base_dtype = resolve_dtype(cfg.dtype, device)  # resolved (resolve_precision): what train_config.yaml records
    # Quantised (models/quantize.py) while loading, straight onto the device: the bf16 base never sits whole
    # in memory when quantize_base is set. With offload the blocks load into host memory and only what stays
    # resident moves to the device.
    load_on = torch.device("cpu") if cfg.offload == "blocks" else device
    # agreed on: a rank that fails to load stops every rank here, not one left in the backend's agreement below;
    # uneven: a node that reads the model from a slower disk loads it minutes after the others, which wait for it
    # through the launcher's store (in the agreement's collective, NCCL's 10-minute timeout ended them)
    with together(world, "load the transformer", uneven=True):
        transformer = load_component(model, "transformer", dtype=base_dtype, device=load_on, quantize=cfg.quantize_base)
        check_loaded_dtype(transformer, dtype_name(base_dtype), "train.dtype")
        from models.qwen21_flow import is_qwen21

        if is_qwen21(transformer):  # 2.1 mixes layouts with its own forward (models/qwen21_multires.py)
            from models.qwen21_multires import install_qwen21

            install_qwen21(transformer)
        else:
            install_multires(transformer)
    use_attention_backend(transformer, cfg.attention_backend, "train.attention_backend", device, base_dtype, world)
    transformer.requires_grad_(False)
    if cfg.quantize_base != "none":
        from models.quantize import install_frozen_linear_backward

        install_frozen_linear_backward(transformer)  # saves the quantised, not a dequantised, weight
    torch.manual_seed(cfg.seed)  # LoRA init: the same on every rank
    add_lora(transformer, cfg.lora)
    if cfg.gradient_checkpointing or cfg.offload == "blocks":
        from models.checkpointing import enable_checkpointing

        enable_checkpointing(transformer, cfg.uncheckpointed_blocks)
    if cfg.compile:  # regional: each block compiled in place (same parameter names); shapes vary per batch
        transformer.compile_repeated_blocks(dynamic=True, **COMPILE_OPTIONS)
    if cfg.offload == "blocks":
        from models.offload import offload_blocks

        offload_blocks(transformer, device, keep=cfg.offload_blocks_on_device)
    else:
        transformer.to(device)
    transformer.train()
    return transformer


def check_shapes(tables: JoinedTables, transformer) -> None:
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


def build_training(r: Run, store: str | Path, model: str, latest: Path | None, resumed: ResumeRecord | None) -> None:
    """Adapter (fresh, from init_lora, or restored from `latest`), optimizer, EMA, sampler and data stream,
    validator, the DDP wrap, micro-batches, trackers and profiler: everything a step needs."""
    _adapter(r, latest)
    _data_order(r, resumed)
    if latest is not None:
        restore(r, latest, resumed)
    elif r.world > 1:  # every rank built the LoRA from train.seed: LoRA dropout would draw the same masks on all
        elastic.seed_rank_rng(r.cfg.seed, 0, r.rank)
    if r.cfg.validate_every is not None or r.cfg.sample_every is not None:
        _validator(r, store, model)
    _wrap(r)
    _batches(r, latest, resumed)
    _trackers(r)


def _adapter(r: Run, latest: Path | None) -> None:
    """The LoRA's start (init_lora on a fresh run), its parameters, optimizer, scheduler and EMA."""
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


def _data_order(r: Run, resumed: ResumeRecord | None) -> None:
    """The sampler and data stream, and what the resume record carries over of them."""
    tc = r.cfg
    # The order is planned for the run's first world size whatever this start's (stages/train/elastic.py).
    canonical = resumed.canonical if resumed is not None else r.world
    # and with the shuffles it started with: a run begun before numpy's goes on with Python's (budget.py)
    shuffle = resumed.shuffle if resumed is not None else PLAN_SHUFFLE
    r.record = replace(r.record, canonical_world_size=canonical, plan_shuffle=shuffle)
    if resumed is not None and train_state.nonfinite_skipped(resumed):  # the steps before this start skipped
        r.record = replace(r.record, extra={**r.record.extra,
                                            train_state.NONFINITE_SKIPPED: train_state.nonfinite_skipped(resumed)})
    sampler = make_sampler(r.tables.lengths, tc.batch_size, tc.max_tokens_per_batch, tc.seed, tc.sampler_window, canonical,
                           shuffle, keys=r.tables.keys)
    r.stream = DataStream(elastic.on_world(sampler, r.world))


def _validator(r: Run, store: str | Path, model: str) -> None:
    """The validator (train.validate_every / sample_every), from this start's step; its damaged val samples said."""
    from stages.train.validate import Validator

    r.validator = Validator(r.cfg, store, model, r.run_dir, r.world, r.main, start_step=r.step,
                            attention_backend=r.record.attention_backend)
    if r.main and r.validator.damaged:
        tqdm.write(f"validation: left out {len(r.validator.damaged)} damaged val sample(s) (train.on_damaged="
                   f"skip): {', '.join(sorted(r.validator.damaged))}")


def _wrap(r: Run) -> None:
    """The DDP wrap (none on one process) of the module whose forward training calls."""
    from models.qwen21_flow import is_qwen21

    if is_qwen21(r.transformer):  # DDP must wrap the module whose forward training calls (models/qwen21_multires.py)
        from models.qwen21_multires import Qwen21Batched

        r.model = parallel.wrap(Qwen21Batched(r.transformer), r.world)
    else:
        r.model = parallel.wrap(r.transformer, r.world)


def _batches(r: Run, latest: Path | None, resumed: ResumeRecord | None) -> None:
    """The damaged reads' tally (tables that skip them), the micro-batches from the stream's position, the result."""
    tc = r.cfg
    r.position = r.stream.position
    if tables_skip(r.tables):
        r.damage = DamageTally(r.run_dir, r.rank, r.world, r.rerun)
        if resumed is not None:  # the run's counts so far: max_damaged_fraction is the run's limit
            r.damage.damaged, r.damage.read = train_state.damaged_reads(resumed)
    r.batches = MicroBatches(r.stream, r.tables, tc, r.rank, r.step, r.device, r.transformer.dtype, depth=tc.prefetch)
    r.result = TrainResult(r.run_dir, r.run_dir / "lora", start_step=r.step, steps=r.step, main_process=r.main,
                           data=r.tables.report, kept_previous=r.kept_previous,
                           init_lora=tc.init_lora if tc.init_lora and latest is None else None)


def _trackers(r: Run) -> None:
    """Rank 0's trackers, and the profiler (train.profile) over the steps left."""
    tc = r.cfg
    if r.main:
        from stages.train.trackers import Trackers

        # purge_step drops events a killed run logged after its last checkpoint, so curves do not double back
        # (at step 0 too: a run killed before its first checkpoint starts again into the same folder)
        r.writer = Trackers(tc.log_with, r.run_dir, {"train": tc.model_dump(mode="json")},
                            purge_step=r.step + 1)
    if tc.profile and tc.max_steps > r.step:
        from stages.train.trackers import StepProfiler

        r.profiler = StepProfiler(min(tc.profile, tc.max_steps - r.step), r.run_dir, r.rank, r.device,
                                   r.rerun, r.world)
