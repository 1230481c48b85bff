"""`pipeline store push STORE URL` / `pipeline store pull URL STORE`: copy committed versions to and from a URL."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from pipeline.commands.common import echo, finite, user_errors
from pipeline.launched import one_process

UrlArg = typer.Argument(..., help="Remote store folder: s3://bucket/prefix (or another fsspec URL).")
OptionsOpt = typer.Option(
    [], "--option", "-o", metavar="<key=value>", help="fsspec storage option KEY=VALUE (value parsed as YAML; repeatable), e.g. "
    "-o endpoint_url=http://127.0.0.1:9000 -o anon=true. Default: the standard AWS environment.",
)
CacheDirOpt = typer.Option(None, "--cache-dir", help="With a store URL (s3://...): the local cache its versions' "
                           "metadata and the shards read are fetched into, and tables are written in before they are "
                           "pushed (default "
                           "~/.cache/qwen-edit-pipeline/stores; $XDG_CACHE_HOME/... when set).")
CacheGbOpt = typer.Option(None, "--cache-gb", callback=finite(above=0), help="Size limit of --cache-dir in GB; least recently used shards "
                          "(and versions nobody uses) beyond it are evicted, also during a read (default: no limit).")


def _options(items: list[str]) -> Optional[dict]:
    from pipeline.commands.common import parse_sets

    return parse_sets(items, flag="--option", form="KEY=VALUE") or None


def push(
    store: Path = typer.Argument(..., help="Local store folder (holds store.json)."),
    url: str = UrlArg,
    option: list[str] = OptionsOpt,
) -> None:
    one_process("store push")  # every rank would upload the same versions
    from store.remote_push import push as do_push

    with user_errors():
        echo(str(do_push(store, url, _options(option))))


def pull(
    url: str = UrlArg,
    store: Path = typer.Argument(..., help="Local store folder (created if missing)."),
    option: list[str] = OptionsOpt,
) -> None:
    one_process("store pull")  # every rank would download the same versions into one folder
    from store.remote_pull import pull as do_pull

    with user_errors(store):
        from pipeline.run_folder import refuse_a_store_among_other_files

        refuse_a_store_among_other_files(store, "STORE")
        echo(str(do_pull(url, store, _options(option))))
