"""`pipeline plan`: predicted peak device memory of each stage for the configured model, precision,
quantisation, offload and batch (models/memory_plan.py), whether it fits --gpu-memory, and how many leading blocks
may be left out of gradient checkpointing there (train.uncheckpointed_blocks)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer

from pipeline.commands.common import (ConfigOpt, SetOpt, config_from, echo, finite, require, usage_error, usage_errors,
                                     user_errors)


def _device_type(device: str) -> str:
    # anything else was planned as a CPU (auto = float32) under the name given: `--device tpu`, `--device gpu`
    if device.split(":")[0] not in ("cuda", "cpu"):
        usage_error(f"--device {device!r}: plan for cuda (cuda:N) or cpu")
    return device


def command(
    config: Optional[Path] = ConfigOpt,
    model: Optional[str] = typer.Option(None, "--model", help="Model folder or hub id (paths.model); the published "
                                        "Qwen/Qwen-Image-Edit(-2509/-2511) ids plan offline from shipped configs."),
    gpu_memory: Optional[float] = typer.Option(None, "--gpu-memory", callback=finite(above=0),
                                               help="GiB of the target GPU: says fit / no fit, and the largest "
                                               "train.uncheckpointed_blocks that fits."),
    tokens: Optional[int] = typer.Option(None, "--tokens-per-sample", min=1,
                                         help="Transformer sequence length per sample (default: from resize.*)."),
    text_tokens: int = typer.Option(300, "--text-tokens", min=0, help="Caption tokens per sample (longest expected)."),
    device: str = typer.Option("cuda", "--device", callback=_device_type,
                               help="Device type planned for: cuda (auto = bf16) or cpu (auto = float32)."),
    processes: int = typer.Option(1, "--processes", min=1, help="Processes training together (`pipeline launch`: "
                                  "nodes x --nproc-per-node); from 2 on DDP's gradient buckets count."),
    set_: list[str] = SetOpt,
) -> None:
    cfg = config_from(config, {"paths.model": model}, set_)
    model_id = require(cfg.paths.model, "--model", "paths.model")
    from models import memory_plan as mp

    rc, tc = cfg.resize, cfg.train
    from stages.train.settings import check_checkpointing

    with usage_errors():  # a train setting the config alone refuses
        check_checkpointing(tc)
    with user_errors():
        family = mp.plan_family(model_id)
        vl_tokens, sample_tokens = _tokens(rc, family, text_tokens)
    seq = tokens or sample_tokens
    budget = tc.max_tokens_per_batch
    with user_errors():
        plans = _plans(cfg, model_id, device, processes, vl_tokens, seq)
    batching = f"token budget {budget} per batch" if budget else f"batch {tc.batch_size}"
    echo(f"model {model_id}: transformer {mp.transformer_counts(model_id).params / 1e9:.2f} B params; "
         f"{seq} tokens per training sample, {batching}, planned for {device}"
         + (f", {processes} processes" if processes > 1 else ""))
    if budget and budget < seq:
        echo(f"  note: train.max_tokens_per_batch {budget} is below a sample's {seq} tokens: train refuses a budget "
             "smaller than the longest training or val sample (naming them) at its start")
    fails = _plan_lines(plans, gpu_memory)
    if gpu_memory is not None:
        _uncheckpointed_line(lambda n: _train_plan(cfg, model_id, device, processes, seq, n, checkpointing=True).total,
                             tc, mp.transformer_counts(model_id).blocks, gpu_memory)
    if fails:
        for stage in fails:
            echo(f"options for {stage} (try one with --set KEY=VALUE): {_options(stage, tc, family)}")
        raise typer.Exit(1)


def _options(stage: str, tc, family: str) -> str:
    """The settings that shrink STAGE's peak (what its plan counts): the train options were named for every stage
    that did not fit, and an encode-vae over the GPU was told to quantize or offload the transformer it never
    loads."""
    if stage == "encode-text":
        view = "resize.control_vl_area" if family == "edit-plus" else "resize.control_vae_area"  # what the VLM sees
        return f"a smaller encode_text.batch_size / {view} (the VL view of each control)"
    if stage == "encode-vae":
        return "a smaller encode_vae.batch_size / resize.target_area"
    if stage.startswith("evaluate"):
        return ("evaluate.quantize_base int8|fp8|nf4 (predict.quantize_base for predict), a smaller "
                "evaluate.batch_size / resize.target_area")
    checkpointing = "" if tc.gradient_checkpointing else "train.gradient_checkpointing true, "
    batch = "train.max_tokens_per_batch" if tc.max_tokens_per_batch else "train.batch_size"
    return (f"train.quantize_base int8|fp8|nf4, train.offload blocks, {checkpointing}a smaller {batch} / "
            "resize.target_area")


def _dtype(name: str, device: str, mixed: str = "no") -> str:
    """A stage's dtype setting as planned: auto is bf16 on cuda (or under bf16 mixed precision), else float32."""
    if name != "auto":
        return name
    return "bfloat16" if device.startswith("cuda") or mixed == "bf16" else "float32"


def _side(rc) -> int:
    """The side of the images a sample grid / evaluate decodes (~target_area)."""
    return max(64, math.isqrt(rc.target_area) // 64 * 64)


def _train_plan(cfg, model_id: str, device: str, processes: int, seq: int, uncheckpointed: int,
                checkpointing: bool | None = None):
    """train's plan with `uncheckpointed` leading blocks out of gradient checkpointing (`checkpointing`: None, the
    config's)."""
    from models import memory_plan as mp

    tc, side = cfg.train, _side(cfg.resize)
    # token-budget batches (train.max_tokens_per_batch) compute up to the budget's tokens per micro-batch
    # (batch size x longest sequence), whatever train.batch_size says: plan the budget, not batch_size x seq
    budget = tc.max_tokens_per_batch
    train_batch, train_seq = (1, budget) if budget else (tc.batch_size, seq)
    return mp.train_plan(model_id, _dtype(tc.dtype, device, tc.mixed_precision), tc.quantize_base, train_batch,
                         train_seq, tc.gradient_checkpointing if checkpointing is None else checkpointing, tc.lora.rank,
                         tc.offload, tc.offload_blocks_on_device, len(tc.lora.target_modules), optimizer=tc.optimizer,
                         processes=processes, sample_vae=tc.sample_every is not None, ema=tc.ema_decay is not None,
                         sample_size=(side, side), uncheckpointed_blocks=uncheckpointed)


def _plans(cfg, model_id: str, device: str, processes: int, vl_tokens: int, seq: int) -> list:
    """The plan of each stage: encode-text, encode-vae, train, evaluate."""
    from models import memory_plan as mp

    rc, side = cfg.resize, _side(cfg.resize)
    return [
        mp.encode_plan(model_id, "text_encoder", _dtype(cfg.encode_text.dtype, device), cfg.encode_text.batch_size,
                       vl_tokens),
        mp.encode_plan(model_id, "vae", _dtype(cfg.encode_vae.dtype, device), cfg.encode_vae.batch_size,
                       rc.target_area // 256),
        _train_plan(cfg, model_id, device, processes, seq, cfg.train.uncheckpointed_blocks),
        # the held-out loss's evaluate.batch_size rows a forward, or a picture's two (true CFG), the larger
        mp.inference_plan(model_id, _dtype(cfg.evaluate.dtype, device), cfg.evaluate.quantize_base, seq,
                          cfg_batch=max(2, cfg.evaluate.batch_size), image_size=(side, side)),
    ]


def _plan_lines(plans: list, gpu_memory: float | None) -> list[str]:
    """One line per stage's plan (its parts; with `gpu_memory`, fits or not); returns the stages that do not fit."""
    from models import memory_plan as mp

    fails = []
    for p in plans:
        detail = ", ".join(f"{k} {mp.gib(v)}" for k, v in p.parts.items())
        verdict = ""
        if gpu_memory is not None:
            ok = p.total <= gpu_memory * 2**30
            fails += [] if ok else [p.stage]
            verdict = "  fits" if ok else f"  DOES NOT FIT in {gpu_memory:g} GiB"
        echo(f"  {p.stage:32s} {mp.gib(p.total):>11s}{verdict}   ({detail})")
    return fails


def _tokens(rc, family: str, text_tokens: int) -> tuple[int, int]:
    """(the text encoder's tokens, the transformer's) of the largest sample resize.* makes for this model family."""
    controls = min(rc.max_controls, 1) if family == "edit" else rc.max_controls  # Edit (v1) keeps one control
    image_tokens = rc.target_area // 256 + controls * (rc.control_vae_area // 256)
    if family == "qwen-image-2.1":
        # the VLM reads the VAE's reference pixels (Qwen3-VL: 32 x 32 px per slot); in the transformer's
        # sequence each slot's place is taken by the reference's latent tokens, counted in image_tokens
        return text_tokens + controls * (rc.control_vae_area // (32 * 32)), image_tokens + text_tokens
    # Qwen2.5-VL (28 x 28 px per token) sees each control at the VAE view (Edit: control_{i}.png) or at
    # control_vl_area (Plus); its image tokens stay in the prompt embeddings the transformer reads
    vl_area = rc.control_vae_area if family == "edit" else rc.control_vl_area
    vl_tokens = text_tokens + controls * (vl_area // (28 * 28))
    return vl_tokens, image_tokens + vl_tokens


def _uncheckpointed_line(plan_of, tc, blocks: int, gpu_memory: float) -> None:
    """The largest train.uncheckpointed_blocks whose training plan fits --gpu-memory (each block left out of
    gradient checkpointing runs once less per step and keeps its activations); offload caps it at the blocks kept
    on the device. Nothing when not even full checkpointing fits (the train line says so)."""
    from models import memory_plan as mp

    most = min(blocks, tc.offload_blocks_on_device) if tc.offload == "blocks" else blocks
    n = mp.largest_uncheckpointed(plan_of, most, gpu_memory * 2**30)
    if n is None:
        return
    if n == blocks and tc.offload == "blocks":  # offload checkpoints its blocks whatever gradient_checkpointing says
        echo(f"  largest that fits {gpu_memory:g} GiB: train.uncheckpointed_blocks {n} (every block keeps its "
             "activations; offload needs train.offload_blocks_on_device at least as many)")
        return
    if n == blocks:
        echo(f"  gradient checkpointing not needed in {gpu_memory:g} GiB: every block's activations fit "
             "(train.gradient_checkpointing false)")
        return
    cap = ", at most train.offload_blocks_on_device" if most < blocks else ""
    echo(f"  largest that fits {gpu_memory:g} GiB: train.gradient_checkpointing true, train.uncheckpointed_blocks {n} "
         f"({n} of {blocks} blocks keep their activations, not recomputed{cap})")
