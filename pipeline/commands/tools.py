"""make-tiny-model, make-demo-data, config show."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipeline.commands.common import (ConfigOpt, SetOpt, config_from, echo, one_of, refuse_a_used_folder, usage_error,
                                     usage_errors, user_errors)
from pipeline.launched import one_process


def make_tiny_model(
    out: Path = typer.Argument(..., help="Folder to write the model to."),
    variant: str = typer.Option("edit", "--variant", help="edit (one control), edit-plus (2509: several controls), edit-2511 (Plus with zero_cond_t) or qwen-image-2.1 (0..10 references)."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same bytes."),
    full_width: bool = typer.Option(False, "--full-width", help="Real component widths (rehearsal; GBs on disk)."),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="--full-width: layers per stack (default: the real counts)."),
) -> None:
    one_process("make-tiny-model")  # every rank would build the same model into OUT
    if variant not in ("edit", "edit-plus", "edit-2511", "qwen-image-2.1"):
        usage_error(f"--variant {variant!r}: use 'edit', 'edit-plus', 'edit-2511' or 'qwen-image-2.1'")
    if layers is not None and not full_width:
        usage_error("--layers needs --full-width")
    if full_width and variant == "edit-2511":  # models/full_width.py builds no other (exit 1 there, after parsing)
        usage_error(f"--variant {variant!r}: --full-width builds 'edit', 'edit-plus' or 'qwen-image-2.1'")
    with usage_errors():  # OUT named on the command line: a mistake there (exit 2), before anything is written
        refuse_a_used_folder(out, "", "build the model into a new or empty folder")
    with user_errors():
        write_tiny_model(out, variant, seed, full_width=full_width, layers=layers)
    echo(f"wrote {'full-width' if full_width else 'tiny'} {variant} model to {out}")


def write_tiny_model(out: Path, variant: str, seed: int, full_width: bool = False, layers: int | None = None) -> Path:
    """The tiny (or full-width rehearsal) model into a new or empty OUT, whole or not at all (never mixed into
    another model or a dataset)."""
    from schemas.errors import UserError
    from store.format import atomic_dir

    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} is not empty: build the model into a new or empty folder")
    with atomic_dir(out) as tmp:
        if full_width:
            from models.full_width import make_full_width_model

            make_full_width_model(tmp, variant=variant, layers=layers, seed=seed)  # type: ignore[arg-type]
        else:
            from models.tiny import make_tiny_model

            make_tiny_model(tmp, variant=variant, seed=seed)  # type: ignore[arg-type]
    return out


def _demo_formats() -> tuple[str, ...]:
    from pipeline.demo_data import FORMATS  # here: the module imports PIL, which --help does not need

    return FORMATS


def make_demo_data(
    out: Path = typer.Argument(..., help="Folder (or tar folder / .jsonl parent) to write the dataset to."),
    n: int = typer.Option(48, "--n", min=1, help="Number of samples."),
    format: str = typer.Option("folder", "--format", callback=one_of(_demo_formats),
                               help="folder | webdataset | jsonl | parquet"),
    max_controls: int = typer.Option(3, "--max-controls", min=0, help="Controls per sample vary in 0..max."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same dataset."),
    with_masks: bool = typer.Option(False, "--with-masks", help="Also write edit-region masks."),
) -> None:
    one_process("make-demo-data")  # every rank would write the same dataset into OUT
    from pipeline.demo_data import make_demo_data as build

    with usage_errors():  # OUT named on the command line: a mistake there (exit 2), before anything is written
        refuse_a_used_folder(out, "", "write demo data into a new or empty folder")
    with user_errors():
        summary = build(out, n=n, fmt=format, max_controls=max_controls, seed=seed, with_masks=with_masks)
    echo(summary)


def config_show(
    config: Optional[Path] = ConfigOpt,
    set_: list[str] = SetOpt,
) -> None:
    from schemas.config import dump_config

    cfg = config_from(config, {}, set_)
    typer.echo(dump_config(cfg), nl=False)
