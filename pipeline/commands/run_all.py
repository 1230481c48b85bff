"""`pipeline run all --config F`: every stage in order (paths from `paths.*`), each skipped when up to date."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipeline.commands.common import SetOpt, config_from, echo, json_mode, usage_errors, user_errors
from pipeline.commands.store_remote import CacheDirOpt, CacheGbOpt
from schemas.units import count_text


def command(
    config: Path = typer.Option(..., "--config", "-c", help="YAML config with paths.{source,store,model,run,report}."),
    set_: list[str] = SetOpt,
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list, one summary object per stage, on stdout "
                                 "(messages go to stderr)."),
    cache_dir: Optional[Path] = CacheDirOpt,
    cache_gb: Optional[float] = CacheGbOpt,
) -> None:
    cfg = config_from(config, {}, set_, shared=True)
    from pipeline.orchestrate import check_config, check_output_folders, run_all

    with usage_errors():  # a missing path, a train setting: refused now, not after resize-bucket and the encoders
        paths = check_config(cfg)
    with user_errors(), usage_errors():  # an output folder refused: 2; one that cannot be read: 1, one line
        check_output_folders(paths)

    if as_json:
        import json
        import sys

        with user_errors(), json_mode(True):
            result = run_all(cfg, log=lambda m: print(m, file=sys.stderr), cache_dir=cache_dir,
                             cache_gb=cache_gb, folders_checked=True)
        from pipeline.commands.common import with_variant

        if not result.metrics:  # a rank other than 0 under a launcher: rank 0 prints the records
            return
        # every stage record names the variant of paths.model (resize-bucket's table is model-independent)
        echo(json.dumps([with_variant(o.result.to_json(), cfg.paths.model) for o in result.outcomes], sort_keys=True))
        return
    with user_errors():
        result = run_all(cfg, log=echo, cache_dir=cache_dir, cache_gb=cache_gb, folders_checked=True)
    if not result.metrics:  # a rank other than 0 under a launcher: rank 0 prints the report's line
        return
    overall = result.metrics["loss"]["overall"]
    echo(f"held-out loss (val, {count_text(overall['n'], 'sample')}): base {overall['base']:.4f} -> "
         f"LoRA {overall['lora']:.4f}")
    echo(f"report: {result.report}")
