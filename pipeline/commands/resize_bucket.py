"""`pipeline run resize-bucket`: source dataset -> `images` table. Flags override the config file's values.

Launched on several ranks it runs on rank 0 while the others wait (pipeline/launched.py), as in `run all`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipeline.commands.common import (
    ConfigOpt, JsonOpt, SetOpt, config_from, echo, emit, json_mode, require, usage_errors, user_errors,
)
from pipeline.commands.store_remote import CacheDirOpt, CacheGbOpt


def command(
    source: Optional[str] = typer.Option(None, "--source", help="Folder, .tar shard(s) (a folder, brace list, http(s):// or s3:// URL), .jsonl manifest, or .parquet file(s) (paths.source)."),
    store: Optional[str] = typer.Option(None, "--store", help="Store folder to write the `images` table to (paths.store), or its URL (s3://bucket/prefix: written in a local cache, then pushed; one node)."),
    config: Optional[Path] = ConfigOpt,
    set_: list[str] = SetOpt,
    val_fraction: Optional[float] = typer.Option(None, "--val-fraction", help="Share of samples in val, drawn by a hash of each pair's pictures or key (resize.val_fraction; resize.split_by)."),
    area: Optional[int] = typer.Option(
        None, "--area", help="Target AND control VAE-view area in pixels, scaled together (resize.area).", min=1),
    target_area: Optional[int] = typer.Option(None, "--target-area", help="Target bucket area in pixels; controls keep theirs (resize.target_area)."),
    multiple: Optional[int] = typer.Option(None, "--multiple", help="Bucket sides are multiples of this, itself a multiple of 16 (resize.multiple)."),
    control_vl_area: Optional[int] = typer.Option(None, "--control-vl-area", help="Area of each control's VL view in pixels (resize.control_vl_area)."),
    control_vae_area: Optional[int] = typer.Option(None, "--control-vae-area", help="Area of each control's VAE view in pixels (resize.control_vae_area)."),
    min_controls: Optional[int] = typer.Option(None, "--min-controls", help="Fewer controls -> quarantined (resize.min_controls)."),
    max_controls: Optional[int] = typer.Option(None, "--max-controls", help="More controls -> quarantined (resize.max_controls)."),
    max_image_pixels: Optional[int] = typer.Option(None, "--max-image-pixels", help="Larger images (pixels) -> quarantined (resize.max_image_pixels)."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Processes resizing in parallel, 0 = inline (resize.workers)."),
    as_json: bool = JsonOpt,
    cache_dir: Optional[Path] = CacheDirOpt,
    cache_gb: Optional[float] = CacheGbOpt,
) -> None:
    cfg = config_from(config, shared=True, sets=set_, overrides=
        {
            "paths.source": source,
            "paths.store": store,
            "resize.val_fraction": val_fraction,
            # --area is resize.area: it sets both keys (a flag wins over the file), and --target-area /
            # --control-vae-area beside it must agree with it, as in a file (schemas/config.py, one rule)
            "resize.area": area,
            "resize.target_area": target_area,
            "resize.multiple": multiple,
            "resize.control_vl_area": control_vl_area,
            "resize.control_vae_area": control_vae_area,
            "resize.min_controls": min_controls,
            "resize.max_controls": max_controls,
            "resize.max_image_pixels": max_image_pixels,
            "resize.workers": workers,
        },
    )
    src = require(cfg.paths.source, "--source", "paths.source")
    dst = require(cfg.paths.store, "--store", "paths.store")
    from stages.resize.stage import check_config

    with usage_errors():  # the stage's own check at its start, here before a store URL is pulled
        check_config(cfg.resize)
    _write_images(cfg, src, dst, as_json, cache_dir, cache_gb)


def _write_images(cfg, src: str, dst: str, as_json: bool, cache_dir: Optional[Path], cache_gb: Optional[float]) -> None:
    """The stage over SRC into DST (checked first), on rank 0 of a launch while the others wait; its summary."""
    from functools import partial

    from pipeline.launched import rank_0_alone

    with user_errors(dst), json_mode(as_json):
        from models.collective import together_before_group
        from pipeline.launched import launched
        from pipeline.run_folder import refuse_a_store_among_other_files

        # each node's view of the folder: one outcome for every rank (rank 0 refused alone, and a rank waiting
        # for it met the launch's store gone, told of a rank killed without a word)
        with together_before_group(launched()[0], "resize-bucket: the store folder"):
            refuse_a_store_among_other_files(dst)
        log = (lambda m: typer.echo(m, err=True)) if as_json else echo  # --json: stdout holds the JSON alone
        # launched on several ranks: one writer of the images table (and of a URL's cache), as in `run all`
        summary = rank_0_alone("resize-bucket", partial(_resize, cfg, src, dst, cache_dir, cache_gb, log))
    if summary is not None:  # None: a rank that waited for rank 0, which prints the summary
        emit(summary, as_json)


def _resize(cfg, src: str, dst: str, cache_dir: Optional[Path], cache_gb: Optional[float], log):
    from stages.resize.stage import run

    from pipeline.store_url import StoreAccess, named_by_url

    with StoreAccess(dst, cache_dir, cache_gb).for_stage("resize-bucket", log) as local:  # a URL: pushed after
        return named_by_url(run(cfg, src, local), dst)

