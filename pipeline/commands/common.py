"""Helpers shared by the command wrappers: config loading with flag overrides, error reporting."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import typer

from pipeline.config import ConfigError, PipelineConfig, load_config

ConfigOpt = typer.Option(None, "--config", "-c", help="YAML config file (sections per stage).", exists=False)


def config_from(path: Path | None, overrides: dict[str, Any]) -> PipelineConfig:
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        typer.secho(str(e), fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn expected errors (bad input, missing table, ...) into one red line and exit 1, not a traceback."""
    from schemas.errors import UserError

    from store.io_errors import describe

    try:
        yield
    except (UserError, ConfigError) as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except Exception as e:  # a full disk / read-only folder missed by a closer handler: still one line
        err = describe(e, "output", Path(getattr(e, "filename", None) or "."))
        if err is None:
            raise
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def require(value: Any, flag: str, key: str) -> Any:
    if value is None:
        typer.secho(f"error: {flag} is required (or set `{key}` in the config file)", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    return value


def echo(msg: str) -> None:
    typer.echo(msg, err=False)
    sys.stdout.flush()
