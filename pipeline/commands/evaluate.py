"""`pipeline run evaluate`: held-out loss + samples, base vs LoRA -> REPORT/{metrics.json, grid.png, index.html}."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipeline.commands.common import (ConfigOpt, JsonOpt, SetOpt, config_from, emit, existing_store, json_mode,
                                     require, usage_error, usage_errors, user_errors)
from pipeline.commands.store_remote import CacheDirOpt, CacheGbOpt


def _local(store: str, cache_dir: Optional[Path], cache_gb: Optional[float]) -> str:
    """`store`, or for a URL its cached copy holding the tables evaluate reads."""
    from store.remote_cache import local_store

    existing_store(store)
    return str(local_store(store, ["text", "vae", "images"], cache_dir, cache_gb, optional=("images",)))


def command(
    store: Optional[str] = typer.Option(None, "--store", help="Store with `text`, `vae` (+ `images`) tables (paths.store), or its URL (s3://bucket/prefix: read through --cache-dir)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model the store was encoded with (paths.model)."),
    lora: Optional[str] = typer.Option(None, "--lora", help="LoRA folder (default: paths.run + /lora)."),
    out: Optional[str] = typer.Option(None, "--out", help="Report directory (paths.report)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto | float32 | bfloat16 | float16 (evaluate.dtype; auto = bf16 on a bf16 GPU, float32 on CPU)."),
    config: Optional[Path] = ConfigOpt,
    set_: list[str] = SetOpt,
    num_samples: Optional[int] = typer.Option(None, "--num-samples", help="Val samples to generate (evaluate.num_samples)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Inference steps (evaluate.num_inference_steps)."),
    device: Optional[str] = typer.Option(None, "--device", help="Device of the transformer: auto, cpu, cuda, cuda:N (evaluate.device)."),
    all_checkpoints: bool = typer.Option(False, "--all-checkpoints", help="Evaluate the base and every kept checkpoint of the run (RUN/checkpoints/step-N): held-out losses into REPORT/losses.zarr, curves, the best checkpoint."),
    run_dir: Optional[str] = typer.Option(None, "--run", help="Run folder (paths.run): --all-checkpoints evaluates its checkpoints, else its LoRA RUN/lora."),
    as_json: bool = JsonOpt,
    cache_dir: Optional[Path] = CacheDirOpt,
    cache_gb: Optional[float] = CacheGbOpt,
) -> None:
    if lora and (all_checkpoints or run_dir):  # one of them would be ignored: the report of another LoRA than named
        usage_error("--all-checkpoints evaluates every checkpoint of --run (or paths.run), --lora one LoRA, and "
                    "--run RUN alone its RUN/lora: pass --lora or --run, not both" if not all_checkpoints else
                    "--lora names one LoRA, --all-checkpoints evaluates every checkpoint of --run (or paths.run): "
                    "pass one of them")
    if not all_checkpoints:  # refused before anything is read: every rank would pull a store URL's cache first
        from pipeline.launched import one_process

        one_process("run evaluate", "; only --all-checkpoints (a run's checkpoints) shares its work between ranks")
    cfg = config_from(config, shared=all_checkpoints, sets=set_, overrides=
        {
            "paths.store": store,
            "paths.model": model,
            "paths.report": out,
            "evaluate.num_samples": num_samples,
            "evaluate.num_inference_steps": steps,
            "evaluate.device": device, "evaluate.dtype": dtype,
        },
    )
    store_dir = require(cfg.paths.store, "--store", "paths.store")
    model_id = require(cfg.paths.model, "--model", "paths.model")
    report = require(cfg.paths.report, "--out", "paths.report")
    _refuse_someones_folder(report, "--out" if out else "paths.report")
    if all_checkpoints:
        _all_checkpoints(cfg, store_dir, model_id, report, run_dir, as_json, cache_dir, cache_gb)
        return
    run_given = run_dir or cfg.paths.run
    lora_dir = require(lora or (str(Path(run_given) / "lora") if run_given else None), "--lora (or --run)",
                       "paths.run")
    _one_lora(cfg, store_dir, model_id, report, lora_dir, as_json, cache_dir, cache_gb)


def _refuse_someones_folder(report: str, what: str) -> None:
    """REPORT a file, or a folder holding other files than an earlier report's (the stage's own check, at its
    start): a mistake on the command line, exit 2 (it was 1), before a store URL is pulled or the model read. Rank
    0 judges, as the stage does (the report is its to write); every rank stops with its line."""
    from models.collective import together_before_group
    from pipeline.launched import launched
    from stages.evaluate.report_folder import check_report_folder

    world, main = launched()
    with usage_errors(), together_before_group(world, "evaluate: the report folder"):
        if main:
            check_report_folder(Path(report), what)


def _one_lora(cfg, store_dir: str, model_id: str, report: str, lora_dir: str, as_json: bool,
              cache_dir: Optional[Path], cache_gb: Optional[float]) -> None:
    """One LoRA (--lora, or RUN/lora) against the base into REPORT."""
    from models.loading import resolve_model
    from models.lora_files import lora_weight_file

    with user_errors(report), json_mode(as_json):
        local = _local(store_dir, cache_dir, cache_gb)
        resolve_model(model_id)  # the paths before torch's import (the stage's): a typo is told at once
        lora_weight_file(lora_dir)
        from stages.evaluate.stage import run

        # a report of the same inputs is up to date, as in `run all`
        result = run(cfg.evaluate, local, model_id, lora_dir, report, skip_if_done=True)
    emit(result, as_json, model_id)

def _all_checkpoints(cfg, store_dir: str, model_id: str, report: str, run_dir: Optional[str], as_json: bool,
                     cache_dir: Optional[Path], cache_gb: Optional[float]) -> None:
    """`--all-checkpoints`: the base and every kept checkpoint of --run (or paths.run) into REPORT."""
    from models.loading import resolve_model
    from pipeline.orchestrate import kept_checkpoints, report_of_kept_run

    run_path = Path(require(run_dir or cfg.paths.run, "--run", "paths.run"))
    with user_errors(report), json_mode(as_json):  # a full disk no closer handler named: the report folder
        from models.collective import together_before_group
        from pipeline.launched import launched
        from schemas.errors import UserError

        # what this node holds (the run folder, its cache of a URL): one outcome for every rank before the
        # process group forms (a rank that stopped alone here left the others waiting for it there)
        with together_before_group(launched()[0], "evaluate: the run folder, store and model"):
            kept = kept_checkpoints(run_path)
            if not kept and launched()[0] <= 1:  # launched, the ranks decide together (the stage's own check)
                raise UserError(f"no checkpoints to evaluate: {run_path} holds no checkpoints/step-N (train "
                                "writes one every train.checkpoint_every steps and at its end: has it trained into "
                                "this folder?); a LoRA alone is evaluated with --lora PATH, without --all-checkpoints")
            local = _local(store_dir, cache_dir, cache_gb)
            resolve_model(model_id)
        from stages.evaluate.checkpoints import run as run_checkpoints  # torch: after the checks

        # relisted at the end: a training beside evaluate writes and prunes checkpoints meanwhile
        result = run_checkpoints(cfg.evaluate, local, model_id, kept, report, skip_if_done=True,
                                 relist=lambda: kept_checkpoints(run_path),
                                 whose_report=report_of_kept_run(run_path))
    if result is not None:  # under a launcher rank 0 reports; the other ranks computed their share
        emit(result, as_json, model_id)
