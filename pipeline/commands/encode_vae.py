"""`pipeline run encode-vae`: `images` -> `vae` table. Flags override the config file's values.

Under `accelerate launch` each process encodes its own share of the samples (the stage reads rank and world
size from the launcher's environment) and rank 0 commits the table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipeline.commands.common import ConfigOpt, config_from, echo, require, user_errors


def command(
    store: Optional[str] = typer.Option(None, "--store", help="Store folder holding the `images` table (paths.store)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model folder or hub id (paths.model)."),
    device: Optional[str] = typer.Option(None, "--device", help="Device of the VAE (encode_vae.device)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Same-size images per forward."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto | float32 | bfloat16 | float16 (encode_vae.dtype; auto = bf16 on a bf16 GPU, float32 on CPU)."),
    config: Optional[Path] = ConfigOpt,
) -> None:
    cfg = config_from(config, {"paths.store": store, "paths.model": model,
                               "encode_vae.device": device, "encode_vae.dtype": dtype, "encode_vae.batch_size": batch_size})
    dst = require(cfg.paths.store, "--store", "paths.store")
    mdl = require(cfg.paths.model, "--model", "paths.model")
    from stages.encode_vae import run

    with user_errors():
        summary = run(cfg, dst, mdl)
    echo(str(summary))
