"""`pipeline store …` and `pipeline migrate …` (placeholder until the store lands)."""

from __future__ import annotations

import typer

store_app = typer.Typer(no_args_is_help=True)
migrate_app = typer.Typer(no_args_is_help=True)


@store_app.command("inspect")
def inspect() -> None:
    raise typer.Exit(3)


@migrate_app.command("v1-to-v2")
def v1_to_v2() -> None:
    raise typer.Exit(3)
