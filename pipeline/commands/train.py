"""`pipeline run train`: `text` + `vae` tables -> LoRA run directory. Flags override the config file's values.

Several processes: `accelerate launch --multi_gpu --num_processes N -m pipeline.cli run train ...`; on a machine
without GPUs (train.device unset or `cpu`) that is one N-rank run over gloo (stages/train/launch.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from pipeline.commands.common import (ConfigOpt, JsonOpt, SetOpt, config_from, emit, existing_store, finite, json_mode,
                                     require, usage_errors, user_errors)

if TYPE_CHECKING:
    from schemas.config import PipelineConfig

# The run folder this command trains into, once resolved: a stop's line (pipeline/cli.py) advises --resume only
# where it has something to continue
RUN_FOLDER: list[str] = []


def command(
    store: Optional[str] = typer.Option(None, "--store", help="Store with `text` and `vae` tables (paths.store)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model folder or hub id the store was encoded with (paths.model)."),
    out: Optional[str] = typer.Option(None, "--out", help="Run directory: checkpoints/, lora/, logs/ (paths.run)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto | float32 | bfloat16 | float16 (train.dtype; auto = bf16 on a bf16 GPU, float32 on CPU)."),
    config: Optional[Path] = ConfigOpt,
    set_: list[str] = SetOpt,
    resume: bool = typer.Option(False, "--resume", help="Continue from the last complete checkpoint in --out."),
    new_run: bool = typer.Option(False, "--new-run", help="Keep the run --out holds (moved to OUT.previous/N-TIME) "
                                 "and train afresh into --out; with --resume only when that run cannot be continued "
                                 "(other tables, model or train config), as `run all` does."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Optimizer steps in all (train.max_steps)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Samples per process per micro-step (train.batch_size; a resume on another process count keeps the global batch)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu, cuda or cuda:N (train.device; unset: a GPU when there is one, else the CPU)."),
    as_json: bool = JsonOpt,
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="With --store s3://...: the local cache the "
                                             "store's text and vae versions are pulled into (default "
                                             "~/.cache/qwen-edit-pipeline/stores; $XDG_CACHE_HOME/... when set)."),
    cache_gb: Optional[float] = typer.Option(None, "--cache-gb", callback=finite(above=0), help="Size limit of --cache-dir in GB; least recently "
                                             "used versions beyond it are evicted (default: no limit)."),
) -> None:
    cfg = _config(config, set_, store, model, out, max_steps, batch_size, device, dtype)
    store_dir = require(cfg.paths.store, "--store", "paths.store")
    model_id = require(cfg.paths.model, "--model", "paths.model")
    run_dir = require(cfg.paths.run, "--out", "paths.run")
    RUN_FOLDER.append(run_dir)
    from stages.train.settings import validate_config

    with usage_errors():  # train's own check at its start, here before a store URL is pulled
        validate_config(cfg.train)

    with user_errors(run_dir), json_mode(as_json):
        store_dir = _this_nodes_inputs(run_dir, store_dir, model_id, resume, new_run, cache_dir, cache_gb)
        from stages.train.recipe import run  # torch and the model stack: after the checks, a typo is told at once

        # a rerun of a finished run (same tables, model and config) is up to date, as in `run all` (--new-run
        # --resume is what run all does); --new-run alone asks for a new training whatever OUT holds
        result = run(cfg, store_dir, model_id, run_dir, resume=resume, new_run=new_run,
                     skip_if_done=resume or not new_run)
    if result.main_process:
        emit(result, as_json, model_id)


def _config(config: Optional[Path], sets: list[str], store: Optional[str], model: Optional[str], out: Optional[str],
            max_steps: Optional[int], batch_size: Optional[int], device: Optional[str],
            dtype: Optional[str]) -> PipelineConfig:
    """The config file, then `--set`, then this command's flags (those given)."""
    return config_from(config, shared=True, sets=sets, overrides={
        "paths.store": store,
        "paths.model": model,
        "paths.run": out,
        "train.max_steps": max_steps,
        "train.batch_size": batch_size,
        "train.device": device, "train.dtype": dtype,
    })


def _this_nodes_inputs(run_dir: str, store_dir: str, model_id: str, resume: bool, new_run: bool,
                       cache_dir: Optional[Path], cache_gb: Optional[float]) -> str:
    """What this node holds - the run folder, its cache of a URL, its model folder or hub download - checked with
    one outcome for every rank before the process group forms (a rank that stopped alone here left the others
    waiting for it there, on another node until its timeout). The local store folder (a URL: its cached copy)."""
    from models.collective import together_before_group
    from models.loading import model_variant
    from pipeline.launched import launched
    from pipeline.run_folder import refuse_a_folder_of_other_files
    from store.remote_cache import local_store

    with together_before_group(launched()[0], "train: the run folder, store and model"):
        refuse_a_folder_of_other_files(Path(run_dir))
        if resume:
            from schemas.errors import UserError
            from stages.train.resume import nothing_to_resume

            if (why := nothing_to_resume(Path(run_dir), new_run)) is not None:
                raise UserError(why)
        existing_store(store_dir)
        store_dir = local_store(store_dir, ["text", "vae"], cache_dir, cache_gb)  # a URL: its cached copy
        model_variant(model_id)  # the model's first read (train.sample_steps' check, then its loading)
    return store_dir
