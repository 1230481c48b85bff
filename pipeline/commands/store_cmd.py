"""`pipeline store inspect|verify|repair|gc STORE` and `pipeline migrate v1-to-v2 STORE`."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import typer

from typing import Optional

from pipeline.commands.common import ConfigOpt, SetOpt, config_from, echo, finite, user_errors
from pipeline.commands.store_remote import CacheDirOpt
from pipeline.launched import one_process, rank_0_only

store_app = typer.Typer(no_args_is_help=True)
migrate_app = typer.Typer(no_args_is_help=True)

StoreOrUrlArg = typer.Argument(..., help="Store folder (holds store.json), or its URL (s3://bucket/prefix).")


@store_app.command("inspect", help="Tables, versions, sample counts, buckets, bytes, lineage.")
def inspect(store: str = StoreOrUrlArg, as_json: bool = typer.Option(False, "--json", help="Machine-readable.")) -> None:
    rank_0_only()  # a URL's metadata fetched, and the report printed, once per launch (not once per rank)
    from store.inspect import describe, render
    from store.remote import is_url

    with user_errors():
        if is_url(store):  # its metadata only (store/remote_view.py)
            from store.remote_view import metadata_copy

            with metadata_copy(store) as copy:
                info = {**describe(copy.root, copy.manifests_at_url, copy.damaged), "store": store}
        else:
            info = describe(Path(store))
    echo(json.dumps(info, indent=2, sort_keys=True) if as_json else render(info))


@store_app.command("verify", help="Re-check every shard and manifest row; exit 1 with one line per problem. A URL: "
                   "each object streamed once from where it lies and checked on the way (nothing is cached).")
def verify(store: str = StoreOrUrlArg,
           cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", hidden=True, help="Unused: verify of a "
                                                    "URL streams every object and caches nothing (kept for scripts)."),
           cache_gb: Optional[float] = typer.Option(None, "--cache-gb", hidden=True, help="Unused, as --cache-dir."),
           ) -> None:
    one_process("store verify")  # every rank would read the whole store
    from schemas.errors import UserError
    from store.remote import is_url
    from store.verify import verify_store

    with user_errors():
        if is_url(store):  # streamed where it lies (store/remote_verify.py): a URL's bytes never land in a cache
            from store.remote_verify import verify_url

            problems, current = verify_url(store)
        else:
            root = Path(store)
            if not (root / "store.json").is_file():
                # the advice `store inspect` gives (store.Store): a typo, or nothing written there yet
                raise UserError(f"no store at {store} (no store.json); check the path, or run a stage first "
                                "(`pipeline run resize-bucket` creates the store)")
            problems = verify_store(root)
            current = _current_versions(root)
    for p in problems:
        echo(p)
    if problems:
        if not is_url(store):  # a store URL's cache: its damage is the remote's, repaired there
            from store.integrity import repair_target

            store = repair_target(Path(store))
        echo(_verify_advice(store, current, problems))
        raise typer.Exit(1)
    echo(f"ok: {store} verified")


def _not_a_cache(root: Path) -> None:
    """Refuse to repair a store URL's local cache folder (which a damaged sample's error used to name): the
    damaged objects are the remote's, the cache holds only what passed its checks, and a repair there would leave
    the remote as it was (it stopped on a shard the cache never kept, in a traceback)."""
    from store.integrity import repair_target

    if (url := repair_target(root)) != str(root):
        from schemas.errors import UserError

        raise UserError(f"{root} is this node's cache of {url}, not a store to repair: run `pipeline store repair "
                        f"{url}` (the damage is in the remote's objects; add the --model / --config the store was "
                        "built with)")


def _current_versions(root: Path) -> dict[str, int]:
    """{table: current version} as root's store.json names them; {} when it is damaged (repair rebuilds it)."""
    from store.remote_verify import current_versions

    return current_versions(root)


def _verify_advice(store: str, current: dict[str, int], problems: list[str]) -> str:
    """What to do about verify's problems: repair recomputes current versions only, so problems in versions
    no longer current (an old version sharing a repaired shard by hard link) stay until gc removes them."""
    import re

    from store.integrity import NO_REPAIR
    from store.remote import is_url
    from store.verify import needs_recompute

    # damage repair cannot fix (a version's schema.json / checksums.json, a current version without its manifest):
    # its line's own advice, once per distinct one, and no `store repair` for it (which refuses it)
    own = [re.search(rf"; ([^;]*); {re.escape(NO_REPAIR)}", p) for p in problems]
    advice = list(dict.fromkeys(m[1] for m in own if m))
    problems_ = [p for p, m in zip(problems, own) if m is None]
    found = [re.match(r"([A-Za-z0-9_]+)/v(\d+)/", p) for p in problems_]
    old = sorted({f"{m[1]}/v{m[2]}" for m in found if m and current.get(m[1]) != int(m[2])})
    if is_url(store) and any(p.startswith(f"{store.rstrip('/')}/store.json ") for p in problems):
        # a remote's store.json: rebuilt from the versions there first (store/remote_record_repair.py)
        advice.append(f"`pipeline store repair {store}` rebuilds its store.json from the versions there, then "
                      "repairs the rest")
    elif mended := [p for p, m in zip(problems_, found) if m is None or current.get(m[1]) == int(m[2])]:
        # current versions, store.json, litter: the stage's --model / --config only where samples may be recomputed
        if any(needs_recompute(p) for p in mended):
            advice.append(f"`pipeline store repair {store}` recomputes what is damaged (with the --model / --config "
                          "the store was built with)")
        else:
            advice.append(f"`pipeline store repair {store}` rewrites what is damaged (no sample recomputed: no "
                          "--model / --config needed)")
    if old:
        advice.append(f"{', '.join(old)} {'is' if len(old) == 1 else 'are'} not current: `pipeline store gc "
                      f"{store}` removes versions nothing current or running reads")
    return f"{len(problems)} problem(s): " + "; ".join(advice)


@store_app.command("gc", help="Remove table versions nothing current references and no running reader (train, "
                   "evaluate, an encode stage) holds a lease on (atomic per version, kill-safe), and the damaged "
                   "versions a repair set aside (v<N>.damaged/). A URL: also the incomplete versions of killed "
                   "pushes, once older than --incomplete-after.")
def gc(
    store: str = StoreOrUrlArg, dry_run: bool = typer.Option(False, "--dry-run", help="Only say what would be removed (and what leases keep)."),
    incomplete_after: float = typer.Option(60.0, "--incomplete-after", callback=finite(at_least=0), help="With a URL: minutes after its newest "
                                           "object that an incomplete version (no manifest, no live push lease) "
                                           "is taken for a killed push's leftovers and removed."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="With a URL: the --cache-dir its `store "
                                             "repair` / `migrate` ran with, where this node's working copy of it "
                                             "is (default ~/.cache/qwen-edit-pipeline/stores): one a killed run "
                                             "left is removed once the URL's store has moved on from it."),
    drop_work: bool = typer.Option(False, "--drop-work", help="With a URL: also remove this node's working copy "
                                   "of a killed `store repair` / `migrate` the URL has not moved on from (its "
                                   "rerun would resume there); never one a running command holds."),
) -> None:
    one_process("store gc")  # every rank would remove the same versions
    from store.remote import is_url

    with user_errors():
        if is_url(store):
            from store.remote_gc import collect as remote_collect
            from store.remote_work import collect_work

            # first: a URL whose prefix is gone (nothing left to collect there) still frees this node's copy
            collect_work(store, cache_dir, dry_run=dry_run, drop=drop_work, echo=echo)

            remote_collect(store, dry_run=dry_run, grace_s=incomplete_after * 60, echo=echo)
            return
        from store.gc import collect
        from store.store import Store

        Store(Path(store), create=False)  # a store, in a format this code reads
        collect(Path(store), dry_run=dry_run, echo=echo)


@store_app.command("repair", help="Recompute exactly the damaged samples into a new version (others carried "
                   "forward), then verify. Needs the --model/--config (and --source for images) the store was built with.")
def repair(
    store: str = StoreOrUrlArg,
    dry_run: bool = typer.Option(False, "--dry-run", help="Only say what is damaged and what would be done."),
    model: Optional[str] = typer.Option(None, "--model", help="Model the text/vae tables were encoded with."),
    source: Optional[str] = typer.Option(None, "--source", help="Source of the images table (default: the one "
                                         "recorded in its schema)."),
    config: Optional[Path] = ConfigOpt,
    set_: list[str] = SetOpt,
    cache_dir: Optional[Path] = CacheDirOpt,
) -> None:
    one_process("store repair")  # every rank would recompute the same samples into the same repair version
    from features.images_versions import encoded_from_replaced
    from features.tables import TABLE_ORDER
    from store import repair as rp
    from store.remote import is_url

    url = store if is_url(store) else None
    cfg = config_from(config, {"paths.model": model, "paths.source": source}, set_)
    with user_errors(), ExitStack() as held:
        if url is not None and _rebuilt_record(url, dry_run):
            return
        if url is not None:  # repaired in a working copy, then pushed back (store/remote_work.py)
            from store.remote_work import publish, replaced_here, working_copy

            # its flock held till the command ends: `store gc URL` never removes the copy of a live repair
            store = held.enter_context(working_copy(url, cache_dir, damaged_ok=True))
        store = Path(store)
        if url is None:
            _not_a_cache(store)
        plan = rp.scan(store, order=TABLE_ORDER)
        if plan.store_json and not plan.current:
            from schemas.errors import UserError

            # nothing to rebuild store.json from: a damaged store.json over no table versions is not a store
            raise UserError(f"{store} is not a store: {plan.store_json}, and it holds no table versions to "
                            "rebuild it from; pass the store folder (the one `pipeline run` wrote)")
        for line in rp.describe(plan):
            echo(line)
        todo = plan.store_json or plan.litter or plan.quarantine or any(t.needs_repair or t.unrepairable for t in plan.tables)
        if not todo or dry_run:
            _nothing_to_repair(url, store, todo, dry_run)
            return
        failed = rp.apply(plan, _recompute(cfg, store), echo)
        # before publish: it removes a URL's working copy
        after = encoded_from_replaced(store, {t.version for t in plan.tables
                                              if t.table == "images" and t.new_version is not None})
        if url is not None:  # replaced: those repair set aside once their new version verified
            publish(url, store, replaced_here(store), echo)
    for f in failed:
        echo(f"not repaired: {f}")
    if failed:
        raise typer.Exit(1)
    echo(f"ok: {url or store} repaired and verified")
    if after:
        echo(after)


def _rebuilt_record(url: str, dry_run: bool) -> bool:
    """A damaged store.json at `url`, rebuilt there from its versions first (the working copy opens the store
    through it): True where this ends the command (a dry run, which scans the rest once it reads)."""
    from store.remote_record_repair import rebuild_damaged_record

    if not rebuild_damaged_record(url, dry_run, echo):
        return False
    if dry_run:
        echo("dry run: nothing changed (the rest of the store is scanned once its store.json is rebuilt)")
    return dry_run


def _nothing_to_repair(url: str | None, store: Path, todo: bool, dry_run: bool) -> None:
    """`store repair` with nothing (left) to repair, or a dry run: at a URL, what a killed repair finished is
    published; else the line, and a URL's working copy removed."""
    from features.images_versions import encoded_from_replaced

    if url is not None and not dry_run:
        from store.remote_work import publish, replaced_here

        if done := replaced_here(store):  # what a killed repair finished
            echo(f"{url}: publishing the repair of {', '.join(f'{t} v{v}' for t, v in done)} an earlier, "
                 "interrupted run finished")
            after = encoded_from_replaced(store, {v for t, v in done if t == "images"})
            publish(url, store, done, echo)
            echo(f"ok: {url} repaired and verified")
            if after:
                echo(after)
            return
    echo(f"nothing to repair: {url or store} is intact" if not todo else "dry run: nothing changed")
    if url is not None:  # a working copy left behind could later push back versions gc removed
        import shutil

        shutil.rmtree(store, ignore_errors=True)


def _recompute(cfg, store: Path):
    """The producing stage of a table, run with the repair's config/model; store/repair.py runs it expecting the
    damaged version's exact lineage (so it resumes the repair version and computes only the damaged samples)."""
    from schemas.errors import UserError

    def run(table: str, schema) -> None:
        stage = schema.lineage.stage
        if stage in ("encode-text", "encode-vae"):
            if cfg.paths.model is None:
                raise UserError(f"table '{table}' is written by {stage}: pass --model (and --config)")
            if stage == "encode-text":
                from stages.encode.text import run as stage_run
            else:
                from stages.encode.vae import run as stage_run
            echo(str(stage_run(cfg, store, cfg.paths.model)))
        elif stage == "resize-bucket":
            from stages.resize.stage import run as resize_run

            src = cfg.paths.source or schema.attrs.get("source")
            if not src:
                raise UserError(f"table '{table}': pass --source (the dataset it was built from)")
            if not cfg.paths.source and _gone(src):
                raise UserError(f"table '{table}' was built from {src}, which is not there any more (moved, "
                                "renamed, another mount?): pass --source where the same dataset is now (its "
                                "content must be the same: only the damaged samples are re-rendered)")
            resize_run(cfg, src, store)
        else:
            raise UserError(f"no stage of this pipeline writes '{stage}' tables: cannot recompute")

    return run


def _gone(source: str) -> bool:
    """A local source recorded in a schema that no longer exists (a URL is not checked here: the stage says)."""
    from stages.resize.shards import is_shard_list
    from store.remote import is_url

    if is_url(source) or "::" in source:
        return False
    p = Path(source)
    return not (p.parent.is_dir() if is_shard_list(source) else p.exists())


@migrate_app.command("v1-to-v2", help="Upgrade every schema-v1 table to a new v2 version (img_shapes derived).")
def v1_to_v2(
    store: str = StoreOrUrlArg, dry_run: bool = typer.Option(False, "--dry-run", help="Only say what would change."),
    cache_dir: Optional[Path] = CacheDirOpt,
) -> None:
    one_process("migrate v1-to-v2")  # every rank would write the same new versions
    from store.migrate import migrate_v1_to_v2
    from store.remote import is_url

    with user_errors():
        if not is_url(store):
            migrate_v1_to_v2(Path(store), dry_run=dry_run, echo=echo)
            return
        from store.remote_work import publish, working_copy

        # migrated in a working copy, then pushed back (store/remote_work.py); its flock held till done
        with working_copy(store, cache_dir) as root:
            steps = migrate_v1_to_v2(root, dry_run=dry_run, echo=echo)
            if steps and not dry_run:
                publish(store, root, [(s.table, s.old) for s in steps], echo, damaged=False)
            else:  # nothing to publish: a working copy left behind could later push back versions gc removed
                import shutil

                shutil.rmtree(root, ignore_errors=True)
