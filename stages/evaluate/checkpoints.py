"""`evaluate --all-checkpoints`: the held-out loss of the base and of every kept checkpoint of a run -> which is best.

Read top to bottom: fingerprint the evaluation (store tables, model, protocol) -> open REPORT/losses.zarr
(`store.loss_array`) -> read the val samples -> load the transformer once -> base losses (when the group has none)
-> per checkpoint not yet in the group: swap its LoRA weights into the one adapter, one `loss_grid`, one append
(a checkpoint already recorded with the same bytes is skipped) -> best = lowest held-out loss over the selecting
half of the val samples, stated over the other half (`selection`; ties to the earlier step) -> generate the val
samples with base, best and last -> metrics.json, index.html with curves.

metrics.json keeps evaluate's `loss` section (base vs the best checkpoint), so whatever read a single-LoRA
report reads this one too; `checkpoints` adds the per-step curves and `best` / `last`.

Here: the steps of one run, every rank taking each together. Their parts: the checkpoints as files
(`checkpoint_files`), the loss array's fingerprint (`loss_fingerprint`), whether the report is current
(`report_current`), the loss passes (`loss_pass`; one checkpoint's weights loaded: `checkpoint_load`; whose
losses a group holds: `whose_losses`), which is best (`best_checkpoint`), the report (`checkpoint_report`) and
the result (`checkpoints_result`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from models.attention import attention_record
from models.held_out import bucket_of
from models.lora_files import KEEPS_NEWEST
from schemas.config import EvaluateConfig
from schemas.errors import UserError
from schemas.stage import few
from stages.evaluate.base_images import FOLDER as BASE_IMAGES
from stages.evaluate.best_checkpoint import summary_held
from stages.evaluate.checkpoint_files import agreed_checkpoints, check_and_hash
from stages.evaluate.checkpoints_result import CheckpointsResult
from stages.evaluate.ema_curve import FOLDER as EMA_LOSSES, ema_checkpoints, ema_settings, todo_line, write_best_lora
from stages.evaluate.loss_fingerprint import (content_fingerprint, earlier_settings, known_fingerprint,
                                              loss_fingerprint, read_fingerprint)
from stages.evaluate.loss_pass import append_ema, append_missing, open_losses
from stages.evaluate.report_current import current_metrics, redone, say_recomputed, trained_on_since
from store import Store
from store.io_errors import writing
from store.loss_array import Axes, LossStore


def run(cfg: EvaluateConfig, store: str | Path, model: str, checkpoints: list[tuple[int, Path]], out: str | Path,
        skip_if_done: bool = False, relist=None, whose_report=None) -> CheckpointsResult | None:
    """Evaluate the base and every (step, LoRA folder) of `checkpoints` into OUT (losses.zarr + the report).
    `relist`: lists the run's checkpoints again (a training beside evaluate writes and prunes them meanwhile:
    `_evaluate_while_training`). `whose_report(OUT)`: asked (rank 0) when OUT's report is not current, whose
    it is (the run a fresh training kept, named; None: unknown), put first in the line saying why. Under a
    launcher the ranks share the loss passes (`stages.evaluate.ranks`); rank 0 returns the result, the others
    None."""
    from contextlib import ExitStack

    from models.collective import together
    from stages.evaluate.ranks import launched
    from stages.evaluate.report_folder import REPORT_LOCK
    from store.format import flock

    out, ranks = Path(out), launched(cfg)
    with ExitStack() as held:
        with together(ranks.world, "evaluate (the report folder)"):
            if ranks.main:  # one evaluate writes a report folder at a time; the second stops naming the first
                out.mkdir(parents=True, exist_ok=True)
                held.enter_context(flock(out / REPORT_LOCK, blocking=False, holder=f"the report folder {out}"))
        return _run(ranks, cfg, store, model, checkpoints, out, skip_if_done, relist, whose_report)


def _run(ranks, cfg: EvaluateConfig, store: str | Path, model: str, checkpoints: list[tuple[int, Path]], out: Path,
         skip_if_done: bool, relist=None, whose_report=None) -> CheckpointsResult | None:
    """The steps of `run`, every rank taking each collective one together (named in `together`'s lines)."""
    from models.collective import together
    from models.precision import auto_note
    from stages.evaluate import trained_val
    from stages.evaluate.base_images import machine
    from stages.evaluate.settings import agreed_config, for_model, say_unused_negative
    from stages.evaluate.transformer_load import load_transformer
    from stages.evaluate.loss_groups import on_every_rank
    from stages.evaluate.val_share import reader

    started = time.perf_counter()
    with together(ranks.world, "evaluate settings"):  # rank 0 makes the images: its node's extra prompt files
        cfg = for_model(cfg, model, check=ranks.main)
    if ranks.main:
        say_unused_negative(cfg, model)
    checkpoints, shas, pruned = _checkpoints_on_disk(ranks, checkpoints, relist)
    # the device and precision every rank computes its share in: one decision of all (a collective, outside
    # `together`): rows of one loss grid in two precisions would be recorded as the one dtype
    device_note = auto_note(cfg.device)  # before the device setting is replaced by the one resolved
    cfg, precision = agreed_config(cfg, model, ranks.world)
    check_same_settings(ranks.world, cfg)
    ema, ema_shas = ema_checkpoints(cfg, checkpoints, ranks)  # a run trained with train.ema_decay: scored too
    with together(ranks.world, "the ranks' devices"):  # every rank computes rows: each one's device recorded
        mine = machine(cfg)
    run = _Evaluation(ranks, cfg, store, model, out, precision, started, on_every_rank(ranks.world, mine), device_note)
    with together(ranks.world, "evaluate settings", uneven=True):  # each node hashes its copy of the model once
        _, settings = loss_fingerprint(cfg, store, model)  # its fingerprint: of the tables read, below
    up_to_date, recorded = _recorded_if_up_to_date(run, settings, checkpoints, shas, skip_if_done, whose_report,
                                                   ema_shas)
    if up_to_date:
        return recorded
    _check_report_folder(run, checkpoints)
    tables, share = _read_val_share(run)
    load = reader(tables, share)
    with tables:  # closed on every path: descriptors, check-ahead thread, read lease
        with together(ranks.world, "check the val samples against the runs' train splits"):
            trained = trained_val.check_checkpoints(  # rank 0 alone decides and says it (it writes the report)
                Store(store, create=False), checkpoints, [s.key for s in share.samples],
                trained_val.val_images_version(tables)) if ranks.main else None
        fingerprint, settings = read_fingerprint(settings, tables)  # the tables read, not those at key time
        earlier = earlier_settings(settings, tables, cfg, out)
        damaged = dict(tables.damaged)
        losses = _losses_opened(run, share.samples, fingerprint, settings, earlier, tables)
        ema_losses = _losses_opened(run, share.samples, *ema_settings(settings, earlier), tables,
                                    run.out / EMA_LOSSES) if ema else None
        base_cache = (out, _base_key(run, settings, share.samples))
        transformer = load_transformer(cfg, model, ranks.world)  # the ranks' one attention backend
        done = _evaluate_while_training(ranks, losses, checkpoints, shas, transformer, share.samples, share.mine,
                                        cfg, load, fingerprint, relist, base_cache, run.computed_on,
                                        (ema_losses, ema_shas) if ema else None)
        if ranks.main:  # rank 0 summarises, generates and writes the report
            return _rank_0_alone(ranks, lambda: _report(run, tables, share, transformer, done, damaged, shas,
                                                        settings, pruned, trained))
        del transformer  # this rank's share is done: its memory goes before it waits for rank 0's report
    _rank_0_alone(ranks, lambda: None)
    return None


@dataclass(frozen=True)
class _Evaluation:
    """What the steps of one `_run` share once its settings are agreed."""

    ranks: object
    cfg: EvaluateConfig
    store: str | Path
    model: str
    out: Path
    precision: object
    started: float  # time.perf_counter() at the start: the result's seconds
    computed_on: list[dict]  # every rank's device and libraries (`loss_groups.on_every_rank`)
    device_note: str = ""  # `models.precision.auto_note` of evaluate.device as set, for the precision line


def _checkpoints_on_disk(ranks, checkpoints: list[tuple[int, Path]],
                         relist) -> tuple[list[tuple[int, Path]], dict[int, str], list[int]]:
    """(the checkpoints every rank agrees on and read, their sha256s, the steps listed but pruned since): all
    pruned already, the ones the training keeps now (`relist`). UserError when none is left."""
    checkpoints = agreed_checkpoints(checkpoints, ranks)
    if not checkpoints:
        # launched (`run all`, `evaluate --all-checkpoints`; one process checks before): it advised --all-checkpoints
        # left out, which `run all` has not, and one LoRA is evaluated in one process only
        raise UserError("no checkpoints to evaluate: the run folder holds no checkpoints/step-N; a run without any is "
                        "evaluated on its final LoRA in one process: `pipeline run evaluate --lora RUN/lora`, or "
                        "`pipeline run all` not under `pipeline launch`")
    listed = [step for step, _ in checkpoints]
    checkpoints, shas = check_and_hash(checkpoints, ranks)
    pruned = [step for step in listed if step not in shas]
    if not checkpoints and relist is not None:  # all pruned already: the ones the training keeps now
        checkpoints, shas = check_and_hash(agreed_checkpoints(relist(), ranks), ranks)
    if not checkpoints:
        raise UserError("every checkpoint of the run was removed while evaluate started: rerun evaluate")
    return checkpoints, shas, pruned


def check_same_settings(world: int, cfg: EvaluateConfig) -> None:
    """The hashed evaluate settings (`cfg.fingerprint()`, with the precision all ranks agreed on) are the same on
    every rank, or every rank stops with one line naming the ranks that differ. Each rank reads --config / --set
    itself: per-node copies that differ (other noise seeds, σ grid, max_loss_samples, lora_scale) would sum rows
    computed under different settings into one loss grid, recorded as rank 0's (as train's `check_same_start`)."""
    from models.collective import differing_ranks, ranks_differ

    (ranks,) = differing_ranks(world, [cfg.fingerprint()])
    if ranks:
        raise UserError(f"evaluate: the ranks do not evaluate with the same settings (their evaluate config "
                        f"fingerprints differ: {ranks_differ(ranks)}): each node reads --config and --set itself, "
                        "and the nodes' copies of the config differ; use one config")


def _recorded_if_up_to_date(run: _Evaluation, settings: dict, checkpoints: list[tuple[int, Path]],
                            shas: dict[int, str], skip_if_done: bool, whose_report=None,
                            ema_shas: dict[int, str] | None = None) -> tuple[bool, CheckpointsResult | None]:
    """With `skip_if_done`, rank 0 looks whether OUT's report is current for these settings and checkpoints (else
    says why it is not), and every rank gets its answer: (True, the recorded result on rank 0, None on the others)
    when it is; (False, None) when evaluate runs."""
    ranks, out = run.ranks, run.out
    done = None
    if skip_if_done and ranks.main:  # the val split named by content, as the array records it (`read_tables`)
        from stages.evaluate.report import report_metrics

        metrics = report_metrics(out)  # read and checked once; damaged: said, None
        now, now_settings, earlier, keys, n = content_fingerprint(run.cfg, run.store, run.model, settings, run.out,
                                                                  metrics)
        why: list[str] = []
        known = known_fingerprint(out, now, now_settings, earlier)
        done = current_metrics(metrics, out, known, checkpoints, shas, run.cfg, now_settings, why, n, ema_shas)
        if done is None:
            whose = whose_report(out) if why and whose_report is not None else None
            if whose:
                why.insert(0, whose)
            say_recomputed(out, why, redone(out, known, checkpoints, shas, now_settings, run.cfg, earlier, keys,
                                            run.computed_on) + todo_line(out, now_settings, ema_shas or {}),
                           trained_on=not whose and bool(why) and trained_on_since(out, known, checkpoints, shas))
    if ranks.from_main([int(done is not None)])[0]:
        if ranks.main:  # the figures are the same, and so is what makes them not held out
            from stages.evaluate.trained_val import say_recorded

            say_recorded(done)
        return True, (CheckpointsResult(done, out / "index.html", up_to_date=True) if ranks.main else None)
    return False, None


def _check_report_folder(run: _Evaluation, checkpoints: list[tuple[int, Path]]) -> None:
    """Rank 0 checks OUT holds nothing but a report's files, names the precision and warns of checkpoints of
    another base model; the others wait (its refusal stops them with its line)."""
    from models.collective import together
    from stages.evaluate.other_base import warn_other_base
    from stages.evaluate.report_folder import check_report_folder

    ranks, cfg = run.ranks, run.cfg
    with together(ranks.world, "the report folder"):
        if ranks.main:
            check_report_folder(run.out)
            ranked = f", {ranks.world} ranks" if ranks.world > 1 else ""
            tqdm.write(run.precision.describe("evaluate", cfg.device, run.device_note + ranked))
            warn_other_base([path for _, path in checkpoints], run.model, [step for step, _ in checkpoints])


def _read_val_share(run: _Evaluation):
    """(the val split's tables, the samples this rank computes): with several ranks each reads only its own
    (stages/evaluate/val_share.py); one process reads outlines (the loss passes read the features batch by
    batch)."""
    from stages.evaluate.val_samples import read_val_samples
    from stages.evaluate.val_share import read_share

    if run.ranks.world > 1:
        return read_share(run.cfg, run.store, run.model, run.ranks)
    return read_val_samples(run.cfg, run.store, run.model)


def _losses_opened(run: _Evaluation, samples, fingerprint: str, settings: dict, earlier: list[dict],
                   tables, folder: Path | None = None) -> LossStore | None:
    """OUT/losses.zarr over the val samples' axes (`open_losses`), opened by rank 0 while the others wait; None
    on the others. `folder`: another group's folder (the EMA's, `ema_curve`) instead of OUT."""
    from models.collective import together

    ranks, cfg = run.ranks, run.cfg
    axes = Axes([s.key for s in samples], [bucket_of(s) for s in samples], *cfg.loss_axes)
    with together(ranks.world, "open the loss array"):
        if ranks.main:
            from stages.evaluate.loss_groups import start_computed_on

            losses = open_losses(folder or run.out, fingerprint, settings, earlier, axes, tables.versions())
            start_computed_on(losses)  # each machine recorded as it computes a row (`_record_rows`)
        else:
            losses = None
    return losses


def _base_key(run: _Evaluation, settings: dict, samples) -> str | None:
    """Rank 0's key of every input of the base losses over the val samples (`base_images.losses_key` of the
    tables read: single-LoRA evaluate's key, so both share OUT/base-losses.safetensors); None on the others."""
    from models.collective import together
    from stages.evaluate.base_images import losses_key

    key = None
    with together(run.ranks.world, "the base losses' inputs"):
        if run.ranks.main:
            key = losses_key(run.cfg, settings, [s.key for s in samples], run.computed_on)
    return key


def _evaluate_while_training(ranks, losses: LossStore | None, checkpoints: list[tuple[int, Path]],
                             shas: dict[int, str], transformer, samples, mine: list[int], cfg: EvaluateConfig, load,
                             fingerprint: str, relist, base_cache: tuple | None = None,
                             computed_on: list[dict] = (), ema: tuple | None = None):
    """Evaluate the checkpoints not in the array, then list the run again (`relist`; None: the list given is all
    there is): a training beside evaluate writes new checkpoints and prunes old ones meanwhile. When a checkpoint
    evaluated is still on disk, the summary names the best of those and the newer ones are left to a rerun
    (named); when every one evaluated was pruned meanwhile, the newer ones are evaluated (newest first) until one
    is still there. Rank 0 returns (evaluated, attached, pruned steps, newer steps, the summary, the pictured
    checkpoints' bytes: `held_bytes`); the others None. Every rank takes each turn of the loop together, and
    rank 0's summary is one decision of all (`together`): its refusals (none left on disk, no finite loss, a
    rewritten checkpoint) stop every rank with its line (none left on disk was rank 0's alone: the others ended
    with status 0). `ema`: (the EMA group, rank 0's, None on the others; step -> EMA sha256): each checkpoint's EMA
    scored after the raw LoRAs (`append_ema`), the summary over both."""
    from models.collective import together

    listed = {step for step, _ in checkpoints}
    evaluated, attached, pruned, first = 0, False, [], True
    while True:
        n, attached, gone = append_missing(ranks, losses, checkpoints, shas, transformer, samples, mine, cfg,
                                           load, attached, first, base_cache, computed_on)
        if ema is not None:
            attached = append_ema(ranks, losses, ema, checkpoints, transformer, samples, mine, cfg, load, attached,
                                   first, computed_on)
        evaluated, pruned, first = evaluated + n, pruned + gone, False
        now = agreed_checkpoints(relist(), ranks) if relist is not None else None
        newer = [c for c in now or [] if c[0] not in listed]
        on_disk = now if now is not None else checkpoints  # no relist: the list given is all there is
        summary = held = None
        with together(ranks.world, "the checkpoints' summary"):
            if ranks.main:
                summary, held = summary_held(losses, samples, cfg, fingerprint, on_disk, shas,
                                             pictured=cfg.num_samples > 0 or bool(cfg.extra_prompts), ema=ema)
                if summary is None and not newer:  # `newer`: the same on every rank (`agreed_checkpoints`)
                    raise UserError(f"no checkpoint recorded in {losses.path} is still on disk and none newer was "
                                    f"written: they were deleted while evaluating, as {KEEPS_NEWEST}; rerun evaluate")
        if not ranks.from_main([int(summary is None)])[0]:  # none left: the newer ones are evaluated
            break
        if ranks.main:
            tqdm.write(f"every checkpoint evaluated was deleted meanwhile, as {KEEPS_NEWEST}: evaluating the "
                       f"{len(newer)} it wrote since, newest first")
        listed |= {step for step, _ in newer}
        checkpoints, new_shas = check_and_hash(newer, ranks)
        pruned += [step for step, _ in newer if step not in new_shas]
        shas.update(new_shas)
        if ema is not None:
            ema[1].update(ema_checkpoints(cfg, checkpoints, ranks)[1])
    if not ranks.main:
        return None
    return evaluated, attached, pruned, sorted(step for step, _ in newer), summary, held


REPORT_WORK = "evaluate: the images and the report"


def _rank_0_alone(ranks, work):
    """Rank 0's images and report (`work`) while the other ranks wait for them through the launcher's store
    (`main_alone`: minutes of generation would pass a collective's timeout), then end together. Before, they
    ended with status 0 as soon as their share was computed, and a failure of rank 0's there (out of memory
    generating, a full disk) was its alone: now it stops them with its line. One process: `work()`."""
    from models.collective import main_alone

    result = main_alone(ranks.world, REPORT_WORK, work, "rank 0 alone makes the images: evaluate.num_samples 0 and no "
                        "extra prompts make none")
    ranks.any([0])  # no rank ends before all are past it: in a plain env:// launch rank 0 serves that store
    return result


def _report(run: _Evaluation, tables, share, transformer, done, damaged: dict, shas: dict[int, str],
            settings: dict, pruned: list[int], trained: list[dict] | None = None) -> CheckpointsResult:
    """Rank 0's part once the losses are in: the images of the best and last checkpoints (and the base), the
    run record, metrics.json and index.html (`_rank_0_alone` runs it)."""
    from stages.evaluate.checkpoint_report import generated_rows, write_checkpoint_report
    from stages.evaluate.generation_summary import generation_summary
    from stages.evaluate.sample_images import pick_samples
    from stages.evaluate.val_share import complete

    cfg, model, store, out = run.cfg, run.model, run.store, run.out
    evaluated, attached, pruned_meanwhile, newer, (metrics, best, last), held = done
    ema = metrics["checkpoints"].get("ema") or {}
    # the bytes each pictured point's losses are of, by path: a step's raw LoRA and its EMA are two files
    recorded = {p: sha for p, sha in zip(ema.get("paths") or [], ema.get("sha256") or [])}
    recorded.update({last["path"]: shas.get(last["step"])} if best.get("weights") == "ema" else
                    {best["path"]: shas.get(best["step"]), last["path"]: shas.get(last["step"])})
    with writing("the report", out):  # a full disk: its line, not "rank 0: ... OSError" (`fails_alone`)
        rows, pictured = [], complete(tables, share, pick_samples(share.samples, cfg.num_samples))
        if cfg.num_samples > 0 or cfg.extra_prompts:
            rows = generated_rows(cfg, model, store, tables, transformer, pictured, best["path"],
                                  best["step"], last["path"], last["step"], attached, damaged, recorded,
                                  base_cache=(out / BASE_IMAGES, settings), held=held)
        write_best_lora(out, transformer, best, cfg.lora_scale, (held or {}).get(best["path"]),
                        recorded.get(best["path"]))
        metrics["generation"] = generation_summary(rows, cfg, model)  # "lora" = the best one
        metrics["run"] = _run_record(cfg, store, model, tables, pictured, damaged, settings,
                                     run.ranks.world, transformer, run.precision)
        metrics["run"]["trained_val"] = trained  # val samples the runs trained on (`trained_val.check`)
        written = write_checkpoint_report(out, metrics, rows)
        if damaged:
            tqdm.write(f"skipped {len(damaged)} damaged val sample(s): {few(damaged)}")
        return CheckpointsResult(metrics, written, evaluated=evaluated, seconds=time.perf_counter() - run.started,
                                 pruned=sorted(set(pruned + pruned_meanwhile)), newer=newer)


def _run_record(cfg: EvaluateConfig, store: str | Path, model: str, tables, samples, damaged: dict, settings: dict,
                world: int, transformer, precision) -> dict:
    """metrics.json's `run`: what the report was computed from and how."""
    from models.precision import precision_record

    return {
        "store": str(Path(store).resolve()), "tables": tables.versions(), "model": str(model),
        "lora_scale": cfg.lora_scale, "val_samples": len(samples), "val_split": tables.report,
        "damaged_samples": damaged, "config": cfg.model_dump(mode="json"), "settings": settings,
        "ranks": world, "attention": attention_record(transformer),
        **({"precision": precision_record(precision)} if world > 1 else {}),  # one process: run.config
    }
