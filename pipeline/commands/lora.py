"""`pipeline lora …` (placeholder)."""

from __future__ import annotations

import typer

lora_app = typer.Typer(no_args_is_help=True)


@lora_app.command("merge")
def merge() -> None:
    raise typer.Exit(3)
