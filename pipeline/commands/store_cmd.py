"""`pipeline store inspect|verify|gc STORE` and `pipeline migrate v1-to-v2 STORE`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from pipeline.commands.common import echo, user_errors

store_app = typer.Typer(no_args_is_help=True)
migrate_app = typer.Typer(no_args_is_help=True)

StoreArg = typer.Argument(..., help="Store folder (holds store.json).")


@store_app.command("inspect", help="Tables, versions, sample counts, buckets, bytes, lineage.")
def inspect(store: Path = StoreArg, as_json: bool = typer.Option(False, "--json", help="Machine-readable.")) -> None:
    from store.inspect import describe, render

    with user_errors():
        info = describe(store)
    echo(json.dumps(info, indent=2, sort_keys=True) if as_json else render(info))


@store_app.command("verify", help="Re-check every shard and manifest row; exit 1 with one line per problem.")
def verify(store: Path = StoreArg) -> None:
    from store.verify import verify_store

    with user_errors():
        if not (store / "store.json").is_file():
            from schemas.errors import UserError

            raise UserError(f"no store at {store} (no store.json)")
        problems = verify_store(store)
    for p in problems:
        echo(p)
    if problems:
        raise typer.Exit(1)
    echo(f"ok: {store} verified")


@store_app.command("gc", help="Remove table versions nothing current references (atomic per version, kill-safe).")
def gc(
    store: Path = StoreArg, dry_run: bool = typer.Option(False, "--dry-run", help="Only say what would be removed."),
) -> None:
    from store.gc import collect
    from store.store import Store

    with user_errors():
        Store(store, create=False)  # a store, in a format this code reads
        collect(store, dry_run=dry_run, echo=echo)


@migrate_app.command("v1-to-v2", help="Upgrade every schema-v1 table to a new v2 version (img_shapes derived).")
def v1_to_v2(
    store: Path = StoreArg, dry_run: bool = typer.Option(False, "--dry-run", help="Only say what would change."),
) -> None:
    from store.migrate import migrate_v1_to_v2

    with user_errors():
        migrate_v1_to_v2(store, dry_run=dry_run, echo=echo)
