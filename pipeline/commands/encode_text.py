"""`pipeline` command wrapper (placeholder until the stage lands)."""

from __future__ import annotations

import typer


def command() -> None:
    typer.secho("not implemented yet", fg=typer.colors.YELLOW)
    raise typer.Exit(3)
