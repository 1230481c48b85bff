"""`evaluate --all-checkpoints`: the held-out loss of the base and of every kept checkpoint of a run -> which is best.

Read top to bottom: fingerprint the evaluation (store tables, model, protocol) -> open REPORT/losses.zarr
(`store.loss_array`) -> read the val samples -> load the transformer once -> base losses (when the group has none)
-> per checkpoint not yet in the group: swap its LoRA weights into the one adapter, one `loss_grid`, one append
(a checkpoint already recorded with the same bytes is skipped) -> best = lowest overall held-out loss (ties to
the earlier step) -> generate the val samples with base, best and last -> metrics.json, index.html with curves.

metrics.json keeps evaluate's `loss` section (base vs the best checkpoint), so whatever read a single-LoRA
report reads this one too; `checkpoints` adds the per-step curves and `best` / `last`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from models.attention import attention_record
from models.held_out import bucket_of, loss_grid
from models.lora_files import KEEPS_NEWEST
from schemas.config import EvaluateConfig
from schemas.errors import UserError
from schemas.stage import few
from stages.evaluate.base_images import FOLDER as BASE_IMAGES
from stages.evaluate.best_checkpoint import near_best_steps, summary_held
from stages.evaluate.checkpoint_files import agreed_checkpoints, check_and_hash
from stages.evaluate.checkpoint_load import PRUNED, load_checkpoint
from stages.evaluate.ema_curve import (FOLDER as EMA_LOSSES, ema_checkpoints, ema_settings, label as ema_label,
                                       todo_line, write_best_lora)
from stages.evaluate.loss_fingerprint import (content_fingerprint, earlier_settings, known_fingerprint,
                                              loss_fingerprint, read_fingerprint, spelled_as)
from stages.evaluate.loss_groups import cells_line, note_computed_on, recorded_on
from stages.evaluate.paired import NOISE_SE, signed
from stages.evaluate.report_current import current_metrics, redone, say_recomputed, trained_on_since
from stages.evaluate.whose_losses import this_runs, this_runs_kept, training_of
from store import Store
from store.io_errors import writing
from store.loss_array import GROUP, Axes, CellDonor, LossStore, cell_donor


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


# ------------------------------------------------------------------------------------------------ the numbers


# ------------------------------------------------------------------------------------------------ the result


@dataclass
class CheckpointsResult:
    metrics: dict
    report: Path
    up_to_date: bool = False
    evaluated: int = 0  # checkpoints whose losses this run computed
    stage: str = "evaluate"
    seconds: float = 0.0
    pruned: list[int] = field(default_factory=list)  # steps a training beside evaluate pruned before their turn
    newer: list[int] = field(default_factory=list)  # steps it wrote meanwhile, not evaluated (a rerun takes them)

    @property
    def best(self) -> dict:
        return self.metrics["checkpoints"]["best"]

    def to_json(self) -> dict:
        from schemas.stage import absolute, summary_record

        c = self.metrics["checkpoints"]
        # the array beside the report, named absolute: an up-to-date report's recorded path was relative to the cwd
        # of the run that wrote it
        return summary_record(self.stage, seconds=self.seconds, up_to_date=self.up_to_date,
                              report=absolute(self.report), val_samples=self.metrics["loss"]["overall"]["n"],
                              losses=absolute(self.report.parent / GROUP),
                              checkpoints=c["steps"], checkpoints_evaluated=self.evaluated,
                              best_checkpoint=self.best["path"], best_step=self.best["step"],
                              best_weights=self.best.get("weights", "lora"),
                              ema_losses=absolute(Path(c["ema"]["losses"])) if c.get("ema") else None,
                              loss_best=self.best["loss"], loss_base=c["base"]["overall"],
                              best_vs_base=self.best.get("vs_base"), runner_up=self.best.get("runner_up"),
                              within_noise_of_best=self.best.get("within_noise"),
                              last_step=c["last"]["step"], damaged_samples=sorted(self.metrics["run"]["damaged_samples"]),
                              checkpoints_pruned=self.pruned, checkpoints_newer=self.newer)

    def __str__(self) -> str:
        b, c = self.best, self.metrics["checkpoints"]
        if self.up_to_date:
            head = f"report {self.report.parent} is up to date ({len(c['steps'])} checkpoints)"
        else:
            head = (f"evaluated {self.evaluated} of {len(c['steps'])} checkpoints "
                    f"({len(c['steps']) - self.evaluated} already in {c['losses']}"
                    + (f"; {len(self.pruned)} deleted meanwhile, skipped: {KEEPS_NEWEST}" if self.pruned else "")
                    + ")")
        sure = ""
        if b.get("vs_base"):  # paired over val samples (reports written before these numbers have none)
            sure = f"; vs base {signed(b['vs_base'])}"
            if b.get("runner_up"):
                sure += (f", next best step {b['runner_up']['step']}{ema_label(b['runner_up'], 'ema' in c)} "
                         f"{signed(b['runner_up'])}")
            sure += _near_best(b, "ema" in c) + f" (paired over {b['vs_base']['n']} val samples, ± s.e.)"
        newer = ""
        if self.newer:
            n = len(self.newer)
            newer = (f"; {n} newer checkpoint{'s were' if n > 1 else ' was'} written meanwhile (step "
                     f"{', '.join(map(str, self.newer))}): rerun to include {'them' if n > 1 else 'it'}")
        return (f"{head}; best checkpoint step {b['step']}{ema_label(b, 'ema' in c)}: held-out loss "
                f"{b['loss']:.4f} (base {c['base']['overall']:.4f}{sure}{_beside(b, c)}) {b['path']}; report: "
                f"{self.report}{newer}")


def _near_best(best: dict, scored_ema: bool, most: int = 10) -> str:
    """', not told apart from it (within 2 s.e.): step 30, step 40' (the first `most`), or '' (none)."""
    near = near_best_steps(best, scored_ema)
    if not near:
        return ""
    return (f", not told apart from it (within {NOISE_SE:g} s.e.): " + ", ".join(near[:most])
            + (f" … ({len(near)} in all)" if len(near) > most else ""))


def _beside(best: dict, c: dict) -> str:
    """The other weights of the best's step, when the EMA was scored: '; its raw LoRA 0.1234' / '; its EMA ...'."""
    ema = c.get("ema")
    if not ema:
        return ""
    on_ema = best.get("weights") == "ema"
    steps, per = (c["steps"], c["per_step"]) if on_ema else (ema["steps"], ema["per_step"])
    if best["step"] not in steps:
        return ""
    return f"; its {'raw LoRA' if on_ema else 'EMA'} {per[steps.index(best['step'])]['overall']:.4f}"


# ------------------------------------------------------------------------------------------------ the stage


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
    from stages.evaluate import stage as single, trained_val
    from stages.evaluate.base_images import machine
    from stages.evaluate.loss_groups import on_every_rank
    from stages.evaluate.val_share import reader

    started = time.perf_counter()
    with together(ranks.world, "evaluate settings"):  # rank 0 makes the images: its node's extra prompt files
        cfg = single.for_model(cfg, model, check=ranks.main)
    if ranks.main:
        single.say_unused_negative(cfg, model)
    checkpoints, shas, pruned = _checkpoints_on_disk(ranks, checkpoints, relist)
    # the device and precision every rank computes its share in: one decision of all (a collective, outside
    # `together`): rows of one loss grid in two precisions would be recorded as the one dtype
    device_note = auto_note(cfg.device)  # before the device setting is replaced by the one resolved
    cfg, precision = single.agreed_config(cfg, model, ranks.world)
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
        transformer = single.load_transformer(cfg, model, ranks.world)  # the ranks' one attention backend
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


def _recorded_if_up_to_date(run: _Evaluation, settings: dict, checkpoints: list[tuple[int, Path]],
                            shas: dict[int, str], skip_if_done: bool, whose_report=None,
                            ema_shas: dict[int, str] | None = None) -> tuple[bool, CheckpointsResult | None]:
    """With `skip_if_done`, rank 0 looks whether OUT's report is current for these settings and checkpoints (else
    says why it is not), and every rank gets its answer: (True, the recorded result on rank 0, None on the others)
    when it is; (False, None) when evaluate runs."""
    ranks, out = run.ranks, run.out
    done = None
    if skip_if_done and ranks.main:  # the val split named by content, as the array records it (`read_tables`)
        now, now_settings, earlier, keys, n = content_fingerprint(run.cfg, run.store, run.model, settings, run.out)
        why: list[str] = []
        known = known_fingerprint(out, now, now_settings, earlier)
        done = current_metrics(out, known, checkpoints, shas, run.cfg, now_settings, why, n, ema_shas)
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
    from stages.evaluate import stage as single
    from stages.evaluate.report_folder import check_report_folder

    ranks, cfg = run.ranks, run.cfg
    with together(ranks.world, "the report folder"):
        if ranks.main:
            check_report_folder(run.out)
            ranked = f", {ranks.world} ranks" if ranks.world > 1 else ""
            tqdm.write(run.precision.describe("evaluate", cfg.device, run.device_note + ranked))
            single.warn_other_base([path for _, path in checkpoints], run.model, [step for step, _ in checkpoints])


def _read_val_share(run: _Evaluation):
    """(the val split's tables, the samples this rank computes): with several ranks each reads only its own
    (stages/evaluate/val_share.py); one process reads outlines (the loss passes read the features batch by
    batch)."""
    from stages.evaluate import stage as single
    from stages.evaluate.val_share import read_share

    if run.ranks.world > 1:
        return read_share(run.cfg, run.store, run.model, run.ranks)
    return single.read_val_samples(run.cfg, run.store, run.model)


def _losses_opened(run: _Evaluation, samples, fingerprint: str, settings: dict, earlier: list[dict],
                   tables, folder: Path | None = None) -> LossStore | None:
    """OUT/losses.zarr over the val samples' axes (`_open_losses`), opened by rank 0 while the others wait; None
    on the others. `folder`: another group's folder (the EMA's, `ema_curve`) instead of OUT."""
    from models.collective import together

    ranks, cfg = run.ranks, run.cfg
    axes = Axes([s.key for s in samples], [bucket_of(s) for s in samples], *cfg.loss_axes)
    with together(ranks.world, "open the loss array"):
        if ranks.main:
            from stages.evaluate.loss_groups import start_computed_on

            losses = _open_losses(folder or run.out, fingerprint, settings, earlier, axes, tables.versions())
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


def _report(run: _Evaluation, tables, share, transformer, done, damaged: dict, shas: dict[int, str],
            settings: dict, pruned: list[int], trained: list[dict] | None = None) -> CheckpointsResult:
    """Rank 0's part once the losses are in: the images of the best and last checkpoints (and the base), the
    run record, metrics.json and index.html (`_rank_0_alone` runs it)."""
    from stages.evaluate import stage as single
    from stages.evaluate.checkpoint_report import generated_rows, write_checkpoint_report
    from stages.evaluate.val_share import complete

    cfg, model, store, out = run.cfg, run.model, run.store, run.out
    evaluated, attached, pruned_meanwhile, newer, (metrics, best, last), held = done
    ema = metrics["checkpoints"].get("ema") or {}
    # the bytes each pictured point's losses are of, by path: a step's raw LoRA and its EMA are two files
    recorded = {p: sha for p, sha in zip(ema.get("paths") or [], ema.get("sha256") or [])}
    recorded.update({last["path"]: shas.get(last["step"])} if best.get("weights") == "ema" else
                    {best["path"]: shas.get(best["step"]), last["path"]: shas.get(last["step"])})
    with writing("the report", out):  # a full disk: its line, not "rank 0: ... OSError" (`fails_alone`)
        rows, pictured = [], complete(tables, share, single.pick_samples(share.samples, cfg.num_samples))
        if cfg.num_samples > 0 or cfg.extra_prompts:
            rows = generated_rows(cfg, model, store, tables, transformer, pictured, best["path"],
                                  best["step"], last["path"], last["step"], attached, damaged, recorded,
                                  base_cache=(out / BASE_IMAGES, settings), held=held)
        write_best_lora(out, transformer, best, cfg.lora_scale, (held or {}).get(best["path"]),
                        recorded.get(best["path"]))
        metrics["generation"] = single.generation_summary(rows, cfg, model)  # "lora" = the best one
        metrics["run"] = _run_record(cfg, store, model, tables, pictured, damaged, settings,
                                     run.ranks.world, transformer, run.precision)
        metrics["run"]["trained_val"] = trained  # val samples the runs trained on (`trained_val.check`)
        written = write_checkpoint_report(out, metrics, rows)
        if damaged:
            tqdm.write(f"skipped {len(damaged)} damaged val sample(s): {few(damaged)}")
        return CheckpointsResult(metrics, written, evaluated=evaluated, seconds=time.perf_counter() - run.started,
                                 pruned=sorted(set(pruned + pruned_meanwhile)), newer=newer)


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
    scored after the raw LoRAs (`_append_ema`), the summary over both."""
    from models.collective import together

    listed = {step for step, _ in checkpoints}
    evaluated, attached, pruned, first = 0, False, [], True
    while True:
        n, attached, gone = _append_missing(ranks, losses, checkpoints, shas, transformer, samples, mine, cfg,
                                            load, attached, first, base_cache, computed_on)
        if ema is not None:
            attached = _append_ema(ranks, losses, ema, checkpoints, transformer, samples, mine, cfg, load, attached,
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


def _append_ema(ranks, losses: LossStore | None, ema: tuple, checkpoints: list[tuple[int, Path]], transformer,
                samples, mine: list[int], cfg: EvaluateConfig, load, attached: bool, first: bool,
                computed_on: list[dict]) -> bool:
    """The EMA of each checkpoint not yet in the EMA group (`ema_curve`), appended as `_append_missing` appends the
    raw LoRAs (one mechanism: plan, cells kept aside, machines recorded), after the raw array's base is copied in
    (rank 0): the same val samples, noise and σ, so the two curves pair sample for sample. Returns `attached`."""
    from models.collective import together
    from models.ema_file import ema_of

    ema_losses, ema_shas = ema
    with together(ranks.world, "the EMA loss array"):
        if ranks.main and not ema_losses.has_base():
            with _writing_losses(ema_losses.path.parent):
                ema_losses.write_base(losses.base())
    todo = [(step, ema_of(path)) for step, path in checkpoints if step in ema_shas]
    _, attached, _ = _append_missing(ranks, ema_losses, todo, ema_shas, transformer, samples, mine, cfg, load,
                                     attached, first, None, computed_on, what="EMA")
    return attached


def _open_losses(out: Path, fingerprint: str, settings: dict, earlier: list[dict], axes: Axes,
                 versions: dict) -> LossStore:
    """OUT/losses.zarr for these settings (rank 0): an array recorded under an earlier spelling of them is
    continued and recorded again under today's, with the table versions read, in one commit."""
    with _writing_losses(out):
        out.mkdir(parents=True, exist_ok=True)
        recorded = known_fingerprint(out, fingerprint, settings, earlier)
        losses = LossStore(out, recorded, axes, settings, versions, take_back=True,
                           spelled=spelled_as(settings, earlier))
        if losses.group.attrs.get("fingerprint") != fingerprint:  # in place or taken back under an earlier spelling
            losses.refingerprint(fingerprint, settings, versions)
        losses.note_versions(versions)  # `pipeline compare` against arrays named by versions (no-op when just noted)
    return losses


def _writing_losses(out: Path):
    """A full disk / read-only folder while losses.zarr is written: one line naming it and OUT (before: the CLI's
    last resort named no file, `disk full while writing output in .`, the cwd's free space)."""
    return writing("the held-out loss array (losses.zarr) of the report", out)


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


def _grid(ranks, transformer, samples, mine: list[int], seeds: list[int], sigmas: list[float], batch_size: int,
          desc: str, load=None, cells: np.ndarray | None = None) -> np.ndarray:
    """`loss_grid` of every sample: in one process all of them; under a launcher this rank's share (`mine`: the
    positions it read, `stages.evaluate.val_share`), summed with the others' (a rank failing in its own pass
    stops every rank: `fails_alone`)."""
    if ranks.world == 1:
        return loss_grid(transformer, samples, seeds, sigmas, batch_size, desc, load=load, cells=cells)
    from models.collective import fails_alone

    # One bar, rank 0's, said to be its share: every rank's progress would take a collective per batch, and the
    # ranks' batch counts differ (shares of unequal size), so they could not all reach it
    shown = f"{desc} [rank 0's share: {len(mine)} of {len(samples)} samples]"
    with fails_alone(ranks.world, desc, "lower evaluate.batch_size"):
        part = loss_grid(transformer, [samples[i] for i in mine], seeds, sigmas, batch_size, shown, show=ranks.main,
                         cells=cells)
    return ranks.full_grid(part, mine, len(samples))


def _plan(losses: LossStore, checkpoints: list[tuple[int, Path]], shas: dict[int, str],
          first: bool, base_kept=lambda: False) -> tuple[list[int], CellDonor | None]:
    """Rank 0's decisions as integers: [base recorded, then per checkpoint whether it is to be evaluated], and
    the group kept aside whose (seed, σ) cells the missing rows take (`store.loss_array.cell_donor`; None: none).
    `first`: the checkpoints listed at the start (later ones: written by the training meanwhile). `base_kept()`:
    is the base in the base-losses file (`_base_row` reads it from there: no donor's cells, nor named in the line)?"""
    # the group the open set aside for other settings: said below, once it is known whether its cells are reused
    opened_aside = f"{losses.aside_reason}: the earlier losses are kept in {losses.kept_aside}; " \
        if losses.kept_aside is not None and losses.taken_back is None and first else None
    if losses.taken_back is not None and losses.kept_aside is None and first:
        tqdm.write(f"the losses of these settings are taken back from {losses.taken_back} (an earlier run stopped "
                   "while it set them back; only checkpoints not in them are evaluated)")
    elif losses.taken_back is not None and first:
        tqdm.write(f"{losses.aside_reason}: the earlier losses are kept in {losses.kept_aside}; those of these "
                   f"settings are taken back from {losses.taken_back} (only checkpoints not in them are evaluated)")
    if losses.unchecked is not None and first:  # an array of an earlier release lacking a chunk of losses
        tqdm.write(losses.unchecked)
    if not this_runs(losses, checkpoints, shas):  # its numbers go aside; this run's kept ones come back
        back = this_runs_kept(losses.path.parent, losses.fingerprint, checkpoints, shas, losses.axes, losses.spelled)
        losses.start_over("the run's checkpoints are not the ones evaluated before", back and back.path)
        tqdm.write(f"{losses.aside_reason}: earlier losses kept in {losses.kept_aside}" +
                   (f"; this run's are taken back from {losses.taken_back} (only checkpoints not in them are "
                    "evaluated)" if back else ""))
    recorded = losses.steps()
    plan = [int(losses.has_base())] + [int(step not in recorded) for step, _ in checkpoints]
    axes = losses.axes
    needed = {step: shas[step] for (step, _), todo in zip(checkpoints, plan[1:]) if todo}  # the rows to compute
    compute_base = not plan[0] and not base_kept()
    donor = cell_donor(losses.path.parent, losses.settings, axes.seeds, axes.sigmas, axes.keys, compute_base,
                       needed) if compute_base or needed else None
    if first and donor is not None:
        n = sum(1 for (step, _), todo in zip(checkpoints, plan[1:]) if todo and donor.holds(step, shas[step]))
        rows = ["the base"] * (compute_base and donor.has_base()) + [f"{n} checkpoint{'s' if n != 1 else ''}"]
        tqdm.write(f"{opened_aside or ''}the (seed, σ) cells both grids hold are taken from {donor.path} "
                   f"({' and '.join(rows)}): {cells_line(donor.known)}")
    elif opened_aside is not None:
        tqdm.write(f"{opened_aside}every checkpoint is evaluated again")
    return plan, donor


@dataclass
class _Shared:
    """Rank 0's plan for `_append_missing`, as every rank receives it (`_shared_plan`)."""

    recorded: bool  # the base's grid is in the array
    todo: list[tuple[int, Path]]  # the checkpoints to evaluate, the newest first
    base_from_donor: bool  # the donor (rank 0's) holds the base
    from_donor: dict[int, int]  # step -> 1 where the donor holds the checkpoint's row under these bytes
    known: np.ndarray  # [seed, σ]: the cells the donor holds


def _append_missing(ranks, losses: LossStore | None, checkpoints: list[tuple[int, Path]], shas: dict[int, str],
                    transformer, samples, mine: list[int], cfg: EvaluateConfig, load=None, attached: bool = False,
                    first: bool = True, base_cache: tuple | None = None,
                    computed_on: list[dict] = (), what: str = "") -> tuple[int, bool, list[int]]:
    """The base's grid (once) and each checkpoint not yet in the array, one append each (rank 0; `losses` is None
    on the others), the newest first: a training beside evaluate prunes the oldest (train.keep_checkpoints), so
    the newest are the ones still there when their turn comes (the array's order is no order: every reader sorts
    by step). Returns (how many checkpoints were evaluated now, whether the adapter is attached to `transformer`,
    the steps pruned before they could be loaded). `base_cache`: (OUT, rank 0's key of the base losses' inputs):
    an array without base losses takes them from there when recorded under the key, and records them there when
    computed (`stages.evaluate.base_losses`). `computed_on`: every rank's machine (`loss_groups.on_every_rank`),
    recorded with the first row computed (`_record_rows`). `what`: the weights named in the bars ("EMA": the
    checkpoints' EMA files, `_append_ema`)."""
    seeds, sigmas = cfg.loss_axes
    shared, donor = _shared_plan(ranks, losses, checkpoints, shas, first, base_cache,
                                 (len(samples), len(seeds), len(sigmas), 3))
    _base_row(ranks, losses, transformer, samples, mine, cfg, load, attached, base_cache,
              recorded=shared.recorded, from_donor=shared.base_from_donor, donor=donor, known=shared.known,
              computed_on=computed_on)
    evaluated, pruned = 0, []
    # no bar with nothing to do: tqdm drew "checkpoints: 0ckpt [00:00, ?ckpt/s]" (no total, no percentage)
    for step, path in tqdm(shared.todo, desc=f"checkpoints' {what}" if what else "checkpoints", unit="ckpt",
                           disable=not ranks.main or not shared.todo):
        partial = bool(shared.from_donor[step])
        if partial and shared.known.all():  # a shrunk grid: every cell of its row recorded under these very bytes
            _record_checkpoint(ranks, losses, step, path, shas[step], (), donor, None)
            continue
        changed, attached = load_checkpoint(ranks, transformer, step, path, shas[step], cfg.lora_scale, attached)
        if changed == PRUNED:
            pruned.append(step)
        if changed:
            continue
        grid = _cells(ranks, transformer, samples, mine, seeds, sigmas, cfg.batch_size,
                      f"held-out loss (step {step}{', ' + what if what else ''})", load,
                      ~shared.known if partial else None)
        _record_checkpoint(ranks, losses, step, path, shas[step], computed_on, donor if partial else None, grid)
        evaluated += 1
    return evaluated, attached, pruned


def _shared_plan(ranks, losses: LossStore | None, checkpoints: list[tuple[int, Path]], shas: dict[int, str],
                 first: bool, base_cache: tuple | None, base_shape: tuple) -> tuple[_Shared, CellDonor | None]:
    """Rank 0's `_plan` (what the array holds, and the donor of cells it takes from: rank 0's alone, None on the
    others) sent to every rank as one list of integers, and read back as a `_Shared` on each."""
    from models.collective import together
    from stages.evaluate import base_losses

    n, cells = len(checkpoints), base_shape[1] * base_shape[2]
    # [base recorded, each checkpoint to evaluate; base from a donor, each checkpoint's row in it; its known cells]
    plan, donor = [0] * (2 * n + 2 + cells), None
    with together(ranks.world, "the loss array"):
        if ranks.main:
            with _writing_losses(losses.path.parent):  # may set an earlier array aside (a rename)
                head, donor = _plan(losses, checkpoints, shas, first, lambda: base_cache is not None and (
                    base_losses.read(Path(base_cache[0]) / base_losses.FILE, base_cache[1], base_shape) is not None))
            plan = head + ([int(donor.has_base())] + [int(donor.holds(step, shas[step])) for step, _ in checkpoints]
                           + donor.known.astype(int).reshape(-1).tolist() if donor else [0] * (n + 1 + cells))
    plan = ranks.from_main(plan)
    return _Shared(
        recorded=bool(plan[0]),
        todo=sorted((c for c, flag in zip(checkpoints, plan[1 : n + 1]) if flag), key=lambda c: c[0], reverse=True),
        base_from_donor=bool(plan[n + 1]),
        from_donor=dict(zip((step for step, _ in checkpoints), plan[n + 2 : 2 * n + 2])),
        known=np.array(plan[2 * n + 2:], dtype=bool).reshape(base_shape[1], base_shape[2])), donor


def _record_checkpoint(ranks, losses: LossStore | None, step: int, path: Path, sha: str, computed_on,
                       donor: CellDonor | None, grid: np.ndarray | None) -> None:
    """One checkpoint's row appended (rank 0), every rank together: `grid` as computed, its cells not computed
    taken from `donor` (a partial row; with `grid` None, every cell: nothing computed, the donor's machines)."""
    from models.collective import together

    with together(ranks.world, f"record checkpoint step {step}"):
        if ranks.main:
            if donor is not None:
                grid = donor.step(step, np.full(losses.axes.shape, np.nan) if grid is None else grid)
            with _writing_losses(losses.path.parent):
                _record_rows(losses, computed_on, donor)
                losses.append(step, str(Path(path).resolve()), sha, grid, training_of(path))


def _base_row(ranks, losses: LossStore | None, transformer, samples, mine: list[int], cfg: EvaluateConfig, load,
              attached: bool, base_cache: tuple | None, recorded: bool, from_donor: bool, donor,
              known: np.ndarray, computed_on: list[dict] = ()) -> None:
    """The base's grid in the array (`_append_missing`): `recorded` already, else from the base-losses file
    (`base_cache`), else computed with the adapter off - with `from_donor` (every rank: the plan's flag) only the
    cells not `known` to rank 0's `donor`, an old group holding the base - and written; then checked finite
    (rank 0)."""
    from contextlib import nullcontext

    from models.collective import together
    from stages.evaluate import base_losses, stage as single

    seeds, sigmas = cfg.loss_axes
    base, reused = None, False
    if not recorded and base_cache is not None:  # one decision of all ranks, rank 0's file
        reused, base = base_losses.agreed_reuse(ranks, *base_cache, (len(samples), len(seeds), len(sigmas), 3))
    base_partial = not recorded and not reused and from_donor  # the donor's cells, the others computed
    if not recorded and not reused:  # the plain model: a checkpoint's adapter, once loaded, bypassed
        # (the newer checkpoints of another training set the array aside after one was evaluated: that LoRA's
        # losses were recorded as the base, and kept in the base-losses file for later runs)
        with single.lora_enabled(transformer, False) if attached else nullcontext():
            base = _cells(ranks, transformer, samples, mine, seeds, sigmas, cfg.batch_size, "held-out loss (base)",
                          load, ~known if base_partial else None)
    with together(ranks.world, "the base losses"):
        if ranks.main:
            if recorded:
                base = losses.base()
            else:
                if base_partial:
                    base = donor.base(base)
                with _writing_losses(losses.path.parent):
                    # wholly a donor's: computed by no rank now (the donor's machines recorded). One read from the
                    # base-losses file (`reused`) was computed on this run's machines: the file's key holds the
                    # device and libraries, every rank's where they differ (`base_images.losses_key`)
                    _record_rows(losses, () if base_partial and known.all() else computed_on,
                                 donor if base_partial else None)
                    losses.write_base(base)
                # the file holds whole computations only: a grown grid's recorded cells are float32
                if base_cache is not None and not reused and not base_partial:
                    base_losses.write(Path(base_cache[0]) / base_losses.FILE, base_cache[1], base)
            # A non-finite base loss means bad stored features (evaluate.on_nonfinite=stop names them): stop
            # before the checkpoints are evaluated, not after all of them
            single.finite_samples(samples, {"base": base}, cfg)


def _record_rows(losses: LossStore, computed_on: list[dict], donor=None) -> None:
    """Rank 0, before it writes a row: the machines that computed its cells recorded on the array (`computed_on`,
    none when nothing was computed), and the donor's record where cells are taken from one
    (`loss_groups.note_computed_on`). A rerun that computes nothing records no machine; an array without a
    record (an earlier release's rows, or none yet) is recorded as such first, before this row makes it hold one."""
    if donor is not None:
        note_computed_on(losses, recorded_on(donor.group), say=False)
    note_computed_on(losses, computed_on)  # a commit only where the record changes


def _cells(ranks, transformer, samples, mine: list[int], seeds: list[int], sigmas: list[float], batch_size: int,
           desc: str, load, cells: np.ndarray | None) -> np.ndarray:
    """`_grid` of the `cells` to compute (None: all); no pass at all when there is none (a shrunk grid)."""
    if cells is not None and not cells.any():
        return np.full((len(samples), len(seeds), len(sigmas), 3), np.nan)
    return _grid(ranks, transformer, samples, mine, seeds, sigmas, batch_size, desc, load, cells)
