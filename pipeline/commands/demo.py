"""`pipeline demo`: tiny offline model + synthetic data + `run all` with configs/demo.yaml, then a summary.

The tiny model is of the family the config's paths.model names (`demo_variant`): Qwen-Image-Edit-Plus for
configs/demo.yaml, Qwen-Image-2.1 for configs/qwen-image-2.1.yaml.

With `--store s3://bucket/prefix` every stage works on the store at that URL through a local cache
(pipeline/store_url.py). Rerunning with the same --workdir reuses everything that is up to date (a killed demo
continues); any other non-empty folder is refused (pipeline/demo_workdir.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

from pipeline.commands.common import SetOpt, echo, usage_errors, user_errors
from pipeline.commands.store_remote import CacheGbOpt
from pipeline.launched import one_process
from schemas.units import count_text

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
DEMO_SAMPLES = 24
BROKEN_STEM = "zz_broken"  # one unreadable sample, so the demo shows the quarantine at work


def _add_broken_sample(data: Path) -> None:
    (data / "target" / f"{BROKEN_STEM}.png").write_bytes(b"\x89PNG\r\n\x1a\n this file was cut short")
    (data / "target" / f"{BROKEN_STEM}.txt").write_text("make the square red\n")


# The tiny models the demo builds (models/tiny.py), each with the name its summary line gives it. Edit (v1) and
# Edit-2511 are left out: no shipped config runs them on the demo data.
DEMO_VARIANTS = {"edit-plus": "Qwen-Image-Edit-Plus", "qwen-image-2.1": "Qwen-Image-2.1"}
# What a model's name says of its family, first match: hub ids (Qwen/Qwen-Image-Edit-2509, ...) and the tiny
# models' folders the configs name (demo-workdir/tiny-qwen-image-2.1)
_NAMED = (("qwen-image-2.1", "qwen-image-2.1"), ("edit-2511", "edit-2511"), ("edit-2509", "edit-plus"),
          ("edit-plus", "edit-plus"), ("qwen-image-edit", "edit"))


def demo_variant(model: str | None, config: Path) -> str:
    """The tiny model's variant for CONFIG's paths.model: a model folder here by its model_index.json, else by its
    name; a name that says no family (configs/demo.yaml's demo-workdir/tiny-model) is Edit-Plus. A UserError
    when that family is one the demo does not build."""
    from schemas.errors import UserError

    variant = _named_variant(model) if model else "edit-plus"
    if variant not in DEMO_VARIANTS:
        raise UserError(f"--config {config}: paths.model {model} is of the {variant} family, and the demo builds tiny "
                        f"{' and '.join(f'{v} ({name})' for v, name in DEMO_VARIANTS.items())} models only; pass a "
                        "config for one of those (configs/demo.yaml, configs/qwen-image-2.1.yaml)")
    return variant


def _named_variant(model: str) -> str:
    """The variant (or, for a model of another family, its name) that MODEL's folder or name says."""
    index = _model_index(Path(model).expanduser() / "model_index.json")
    if index is not None:  # a model folder here: its pipeline class
        from models.loading import model_variant
        from schemas.errors import UserError

        try:
            return model_variant(model)
        except UserError:  # a class this package trains none of (or a folder not complete): named as it is
            return str(index.get("_class_name"))
    name = model.lower()
    found = next((variant for part, variant in _NAMED if part in name), None)
    if found is None and "qwen-image" in name:  # Qwen-Image-Layered, the text-to-image Qwen-Image, ...
        return model.rstrip("/").rsplit("/", 1)[-1]
    return found or "edit-plus"


def _model_index(path: Path) -> dict | None:
    """PATH's model_index.json as a dict; None where there is none, or it does not parse as a JSON object (then the
    model's name tells what it can)."""
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):  # none, unreadable, not UTF-8 or not JSON
        return None
    return index if isinstance(index, dict) else None


def default_workdir(variant: str) -> Path:
    """The workdir without --workdir: one per family, so `pipeline demo` and `pipeline demo --config
    configs/qwen-image-2.1.yaml` both run without a flag (one workdir holds one family's tiny model)."""
    return Path("demo-workdir" if variant == "edit-plus" else f"demo-workdir-{variant}")


def refuse_another_family(model: Path, variant: str) -> None:
    """A UserError when MODEL (WORKDIR/tiny-model) holds an earlier demo's model of another family: reused, the
    run would encode and train that model with settings meant for VARIANT."""
    from models.loading import model_variant
    from schemas.errors import UserError

    if not (model / "model_index.json").is_file() or (have := model_variant(str(model))) == variant:
        return
    workdir = model.parent
    raise UserError(f"--workdir {workdir} holds an earlier demo's tiny {have} model ({model}), and this config is "
                    f"for the {variant} family: pass a new or empty --workdir (e.g. --workdir {workdir}-{variant})")


def prepare_inputs(model: Path, data: Path, max_controls: int, variant: str = "edit-plus") -> None:
    """The tiny model and the synthetic data, each built once (a rerun reuses them)."""
    from pipeline.commands.tools import write_tiny_model
    from pipeline.demo_data import make_demo_data

    if not (model / "model_index.json").is_file():
        echo("== make-tiny-model")  # before the write: the bar of its shards' write goes under its header
        write_tiny_model(model, variant=variant, seed=0)
        echo(f"wrote a tiny random-init {DEMO_VARIANTS[variant]} model to {model}")
    if not (data / "target").is_dir():
        echo("== make-demo-data")
        echo(make_demo_data(data, n=DEMO_SAMPLES, fmt="folder", max_controls=max_controls, seed=0, with_masks=True))
    if not (data / "target" / f"{BROKEN_STEM}.txt").is_file():  # its own check: a kill right after the data
        _add_broken_sample(data)  # left a rerun without it (no quarantine shown, the summary differing)


def summary_lines(cfg, result, store: Path, effective: Path, rerun_flags: str = "") -> list[str]:
    """Samples, quarantine, steps, loss before/after training (train and held-out), where the report is."""
    from store import Store

    st = Store(store, create=False)
    with st.reader("images") as images:
        splits = images.manifest.column("split").to_pylist()
    from store.quarantine import samples_by_reason

    reasons = samples_by_reason(st.quarantine())  # samples, not rows (a row may stand for several)
    loss = result.metrics["loss"]
    mask = loss.get("mask")
    train = next(o for o in result.outcomes if o.stage == "train")
    lines = [
        "",
        "== demo summary",
        f"samples      {len(images)} in the store (train {splits.count('train')}, val {splits.count('val')}), "
        f"{len(loss['per_bucket'])} val buckets",
        f"quarantined  {sum(reasons.values())}" + (f" ({', '.join(sorted(reasons))})" if reasons else ""),
        f"train steps  {cfg.train.max_steps} (batch {cfg.train.batch_size}, LoRA rank {cfg.train.lora.rank})"
        + (" — up to date, not retrained" if train.skipped else ""),
    ]
    if result.train_losses:
        from stages.train.summary import loss_phrase

        lines.append("train loss  " + loss_phrase(result.train_losses, result.train_epochs).removeprefix("train loss"))
    lines.append(
        f"val loss     base {loss['overall']['base']:.4f} -> LoRA {loss['overall']['lora']:.4f} "
        f"(held-out, {count_text(loss['overall']['n'], 'sample')} x {count_text(len(loss['noise_seeds']), 'seed')} "
        f"x {len(loss['timesteps'])} σ)"
    )
    if mask:
        lines.append(
            f"  in mask    base {mask['inside']['base']:.4f} -> LoRA {mask['inside']['lora']:.4f}; outside "
            f"base {mask['outside']['base']:.4f} -> LoRA {mask['outside']['lora']:.4f}"
        )
    lines += [
        f"report       {result.report}",
        f"config       {effective} (rerun: pipeline run all --config {effective}{rerun_flags})",
    ]
    return lines


def command(
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Where the model, data, store, run and report go "
                                           "(default: demo-workdir; demo-workdir-qwen-image-2.1 for a 2.1 config)."),
    config: Path = typer.Option(DEMO_CONFIG, "--config", "-c", help="Stage settings (paths.* are set to --workdir); "
                                "the tiny model is of the family its paths.model names (Edit-Plus or Qwen-Image-2.1)."),
    set_: list[str] = SetOpt,
    store: Optional[str] = typer.Option(None, "--store", help="The store's folder or URL (s3://bucket/prefix; "
                                        "endpoint and credentials from the AWS_* environment). Default: "
                                        "WORKDIR/store."),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help="With --store s3://...: the local cache "
                                             "(default WORKDIR/store-cache)."),
    cache_gb: Optional[float] = CacheGbOpt,
) -> None:
    t0 = time.perf_counter()
    from pipeline.commands.common import config_from

    named = config_from(config, {}, set_).paths.model  # the family the config is for, before paths.* are replaced
    with usage_errors():  # a config the demo cannot use: a command-line mistake (exit 2), before any work
        variant = demo_variant(named, config)
    workdir = (workdir or default_workdir(variant)).resolve()
    effective = workdir / "config.yaml"  # what ran, so the user can rerun or edit it
    # every rank would build the same model and data into the workdir; its `run all` is the part that launches
    one_process("demo", f"; then `pipeline launch --nproc-per-node N run all --config {effective}` runs its stages "
                "on N ranks")
    from schemas.config import dump_config
    from pipeline.orchestrate import run_all

    paths = {"source": workdir / "data", "store": store or workdir / "store", "model": workdir / "tiny-model",
             "run": workdir / "run", "report": workdir / "report"}
    cfg = config_from(config, {f"paths.{k}": str(v) for k, v in paths.items()}, set_)
    from pipeline.demo_workdir import claim_workdir, refuse_other_folder, write_config

    with usage_errors():  # a --workdir the demo cannot use: a command-line mistake (exit 2), before any work
        refuse_other_folder(workdir)
        refuse_another_family(paths["model"], variant)
    with user_errors():
        claim_workdir(workdir)
        kept = write_config(effective, dump_config(cfg))
    if kept is not None:
        echo(f"{effective} held other settings than this demo's (edited since?): kept as {kept} (run them with "
             f"`pipeline run all --config {kept}`); this demo runs with --config {config}")

    with user_errors():
        prepare_inputs(paths["model"], paths["source"], cfg.resize.max_controls, variant)
        from pipeline.store_url import StoreAccess

        access = StoreAccess(str(paths["store"]), cache_dir or workdir / "store-cache", cache_gb)
        result = run_all(cfg, log=echo, cache_dir=access.cache_dir, cache_gb=cache_gb)
        local = access.local(["images"])  # the store itself, or its cached copy
        flags = f" --cache-dir {access.cache_dir}" if local != Path(paths["store"]) else ""
        lines = summary_lines(cfg, result, local, effective, flags)
    echo("\n".join(lines + [f"time         {time.perf_counter() - t0:.0f} s"]))
