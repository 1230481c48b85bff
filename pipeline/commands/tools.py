"""make-tiny-model, make-demo-data, config show."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipeline.commands.common import ConfigOpt, config_from, echo, user_errors


def make_tiny_model(
    out: Path = typer.Argument(..., help="Folder to write the model to."),
    variant: str = typer.Option("edit", "--variant", help="edit (one control) or edit-plus (several controls)."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same bytes."),
    full_width: bool = typer.Option(False, "--full-width", help="Real component widths (rehearsal; GBs on disk)."),
    layers: Optional[int] = typer.Option(None, "--layers", help="--full-width: layers per stack (default: the real counts)."),
) -> None:
    if variant not in ("edit", "edit-plus"):
        raise typer.BadParameter("use 'edit' or 'edit-plus'", param_hint="--variant")
    if layers is not None and not full_width:
        raise typer.BadParameter("--layers needs --full-width", param_hint="--layers")
    with user_errors():
        if full_width:
            from models.full_width import make_full_width_model

            make_full_width_model(out, variant=variant, layers=layers, seed=seed)  # type: ignore[arg-type]
        else:
            from models.tiny import make_tiny_model as build

            build(out, variant=variant, seed=seed)  # type: ignore[arg-type]
    echo(f"wrote {'full-width' if full_width else 'tiny'} {variant} model to {out}")


def make_demo_data(
    out: Path = typer.Argument(..., help="Folder (or tar folder / .jsonl parent) to write the dataset to."),
    n: int = typer.Option(48, "--n", help="Number of samples."),
    format: str = typer.Option("folder", "--format", help="folder | webdataset | jsonl"),
    max_controls: int = typer.Option(3, "--max-controls", help="Controls per sample vary in 0..max."),
    seed: int = typer.Option(0, "--seed"),
    with_masks: bool = typer.Option(False, "--with-masks", help="Also write edit-region masks."),
) -> None:
    from pipeline.demo_data import make_demo_data as build

    with user_errors():
        summary = build(out, n=n, fmt=format, max_controls=max_controls, seed=seed, with_masks=with_masks)
    echo(summary)


def config_show(
    config: Optional[Path] = ConfigOpt,
    set_: list[str] = typer.Option([], "--set", help="Override a key: --set train.batch_size=8 (YAML value)."),
) -> None:
    import yaml

    from pipeline.config import dump_config

    overrides = {}
    for item in set_:
        if "=" not in item:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--set")
        k, v = item.split("=", 1)
        overrides[k.strip()] = yaml.safe_load(v)
    cfg = config_from(config, overrides)
    typer.echo(dump_config(cfg), nl=False)
