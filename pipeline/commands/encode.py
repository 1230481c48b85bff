"""`pipeline run encode-text` (`images` -> `text`) and `encode-vae` (`images` -> `vae`). Flags override the config.

Under `accelerate launch` each process encodes its own share of the samples (the stage reads rank and world
size from the launcher's environment) and rank 0 commits the table.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable, Optional

import typer

from pipeline.commands.common import (
    ConfigOpt, JsonOpt, SetOpt, config_from, echo, emit, existing_store, finite, json_mode, require, user_errors,
)


def _command(section: str, stage_module: str, component: str, batch_help: str, out_table: str) -> Callable[..., None]:
    def command(
        store: Optional[str] = typer.Option(None, "--store", help="Store folder holding the `images` table (paths.store), or its URL (s3://bucket/prefix: encoded in a local cache, then pushed back; on several nodes each node's ranks upload their own shards and rank 0 commits)."),
        model: Optional[str] = typer.Option(None, "--model", help="Model folder or hub id (paths.model)."),
        device: Optional[str] = typer.Option(None, "--device", help=f"Device of the {component} ({section}.device)."),
        batch_size: Optional[int] = typer.Option(None, "--batch-size", help=batch_help),
        dtype: Optional[str] = typer.Option(
            None, "--dtype", help=f"auto | float32 | bfloat16 | float16 ({section}.dtype; auto = bf16 on a bf16 GPU, "
            "float32 on CPU)."),
        config: Optional[Path] = ConfigOpt,
        set_: list[str] = SetOpt,
        as_json: bool = JsonOpt,
        cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="With --store s3://...: the local cache "
                                                 "(default ~/.cache/qwen-edit-pipeline/stores; $XDG_CACHE_HOME/... when set)."),
        cache_gb: Optional[float] = typer.Option(None, "--cache-gb", callback=finite(above=0), help="Size limit of --cache-dir in GB (least recently used shards evicted)."),
    ) -> None:
        cfg = config_from(config, shared=True, sets=set_, overrides={
            "paths.store": store, "paths.model": model, f"{section}.device": device, f"{section}.batch_size": batch_size,
            f"{section}.dtype": dtype,
        })
        dst = require(cfg.paths.store, "--store", "paths.store")
        mdl = require(cfg.paths.model, "--model", "paths.model")

        from pipeline.rank_output import is_rank_0, stdout_of_rank_0

        # launched: rank 0's lines only, as under `run all` (the summary counts every rank's share)
        with stdout_of_rank_0(is_rank_0()):
            with user_errors(dst), json_mode(as_json):
                from pipeline.store_url import named_by_url
                from store.remote_cache import local_store, push_back

                from models.collective import together_before_group
                from models.loading import model_variant
                from pipeline.launched import launched

                # what this node holds (its cache of a URL, its model folder or hub download): one outcome for
                # every rank before the process group forms (a rank that stopped alone here left the others
                # waiting for it there, on another node until its timeout)
                with together_before_group(launched()[0], f"{section.replace('_', '-')}: the store and model"):
                    existing_store(dst)
                    # a URL: encode into a local cached copy (its images, and the output table for reuse), then
                    # push it
                    local = local_store(dst, ["images", out_table], cache_dir, cache_gb, optional=(out_table,))
                    model_variant(mdl)  # the stage's first read of the model
                # the heavy stack (torch) loads once the store and model are there: a mistyped path is told at once
                run = importlib.import_module(stage_module).run
                summary = named_by_url(run(cfg, local, mdl), dst)
                if summary.committed_to:  # several nodes' caches: each rank uploaded its part, rank 0 committed
                    if summary.rank == 0:
                        echo(summary.committed_line())
                elif is_rank_0() and (pushed := push_back(dst, local)) is not None:
                    echo(str(pushed))  # rank 0 committed the table; the push says when a newer one stays current
                    summary.newer_current = pushed.newer_current(summary.table)  # --json says it too
            emit(summary, as_json, mdl)

    return command


text_command = _command(
    "encode_text", "stages.encode.text", "text encoder",
    "Prompts per forward (encode_text.batch_size; same shape with batching=exact, similar length with padded).",
    "text",
)
vae_command = _command("encode_vae", "stages.encode.vae", "VAE", "Same-size images per forward (encode_vae.batch_size).",
                       "vae")
