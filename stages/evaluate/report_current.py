"""Is OUT's `evaluate --all-checkpoints` report current (`current_metrics`: the same loss array, every checkpoint
with its present bytes and path, the same settings, `schemas.up_to_date`'s rules), and when it is not: why
(`differences`, `say_recomputed`) and what is computed again (`redone`). Single-LoRA evaluate (`report_inputs`) reads the
same rules for its report: the earlier config fingerprints, the damaged and non-finite samples left out."""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from schemas import up_to_date as current
from schemas.config import EvaluateConfig
from schemas.lineage import hashed_settings, settings_hash, unhashed_names
from schemas.units import count_text
from stages.evaluate.base_images import extra_prompt_bytes
from stages.evaluate.ema_curve import best_lora_input
from stages.evaluate.loss_fingerprint import spelled_as
from stages.evaluate import selection
from stages.evaluate.loss_groups import cells_line
from stages.evaluate.whose_losses import other_weights, this_runs, this_runs_kept
from store.loss_array import GROUP, Axes, LossGroup, cell_donor, kept_groups, recorded_steps


def current_metrics(metrics: dict | None, out: Path, fingerprint: str, checkpoints: list[tuple[int, Path]],
                    shas: dict[int, str], cfg: EvaluateConfig, settings: dict | None = None,
                    why: list[str] | None = None, n: int | None = None,
                    ema_shas: dict[int, str] | None = None) -> dict | None:
    """OUT's report (`metrics`, as the check read it once: `report.report_metrics`; None: no intact report) when it
    is current (`schemas.up_to_date`): the same loss array (`fingerprint`),
    every checkpoint recorded with its present bytes (`shas`) and path (a moved run: the report names the new
    paths), the same evaluate settings (`config_spellings.same_config`; `n`: the val split's size, which says which caps
    read every sample) and extra prompts' image bytes (pictures only: the array is kept). `why`: filled, when
    OUT holds a report that is not current, with what differs (`differences`; `settings`: the loss array's
    settings of this run, `loss_fingerprint`). `ema_shas`: step -> the sha256 of its EMA file, of the checkpoints
    whose EMA is scored (`ema_curve`): a report of a run without EMA records none and needs none (it stays
    current); one that scored no EMA where there is one now (made before EMA was scored) is not current."""
    from stages.evaluate.report import report_whole

    if metrics is None or not report_whole(out):
        return None
    recorded = recorded_steps(out, fingerprint)  # None: no loss array of these settings
    try:  # a metrics.json damaged into other valid JSON (a list, a number for a section) is no report either
        c = metrics.get("checkpoints", {})
        recorded_paths = dict(zip(c.get("steps") or [], c.get("paths") or []))
        # the LoRA bytes the report's numbers are of, as it records them: the array's may be newer (checkpoints
        # retrained under the same steps and paths, their losses appended, evaluate killed before this report was
        # rewritten: the old report then passed for theirs). Reports from before it recorded them: the array's.
        reported = dict(zip(c.get("steps") or [], c["lora_sha256"])) if "lora_sha256" in c else (recorded or {})
        recorded_inputs = {"fingerprint": c.get("fingerprint"), "steps": c.get("steps"),
                           "config_fingerprint": c.get("config_fingerprint"),
                           "extra_prompts_sha256": c.get("extra_prompts_sha256"),
                           "loras": {str(step): reported.get(step) for step, _ in checkpoints},
                           "paths": {str(step): recorded_paths.get(step) for step, _ in checkpoints}}
        picked = _selection_inputs(c)
        named = named_steps(c)
        listed = listed_on_disk(c, named)
        ema_inputs = _ema_inputs(c, checkpoints, ema_shas or {})
    except (AttributeError, TypeError, KeyError, ValueError):
        return None
    present = {"fingerprint": fingerprint, "steps": sorted(recorded) if recorded is not None else c.get("steps"),
               "config_fingerprint": cfg.fingerprint(), "extra_prompts_sha256": extra_prompt_bytes(cfg) or None,
               "loras": {str(step): shas[step] for step, _ in checkpoints},
               "paths": {str(step): str(Path(path).resolve()) for step, path in checkpoints}}
    # in this order (the line saying why a report is redone lists its inputs in the present's order)
    recorded_inputs.update(picked[0])
    present.update(picked[1])
    # the checkpoints the report names (best, next best, last) are still there: one removed since (pruned, or
    # deleted by hand) left the report "up to date" naming a path that is gone as the best
    recorded_inputs["named_on_disk"] = named
    present["named_on_disk"] = [step for step in named if step in dict(checkpoints)]
    # and every other step it lists as on disk: one removed since stayed "up to date" listed with its path as any
    # other (metrics.json's on_disk true), not marked removed; rewritten, no checkpoint is evaluated again
    recorded_inputs["listed_on_disk"] = listed
    present["listed_on_disk"] = [step for step in listed if step in dict(checkpoints)]
    recorded_inputs.update(ema_inputs[0])
    present.update(ema_inputs[1])
    from stages.evaluate.config_spellings import same_config

    if same_config(recorded_inputs["config_fingerprint"], cfg, n, metrics):  # the same settings, spelled otherwise
        present["config_fingerprint"] = recorded_inputs["config_fingerprint"]
    if recorded is not None and current.is_current(recorded_inputs, present) and damaged_current(metrics, cfg) \
            and nonfinite_current(metrics, cfg):
        return metrics
    if why is not None:
        why += differences(recorded_inputs, present, metrics, cfg, settings)
    return None


def _selection_inputs(c: dict) -> tuple[dict, dict]:
    """(recorded, present) of how the best was picked: on half the val samples, confirmed on the other (a report
    from before stated the winner's own, optimistic numbers), its verdict and '≈ best' by the threshold of now (a
    report told apart by 2 s.e. over 3 samples). A report of another rule is summarised again, no checkpoint
    evaluated again."""
    chosen = c.get("selection") or {}
    return ({"selection": chosen.get("rule") or selection.UNRECORDED,
             "verdict": chosen.get("verdict") or selection.VERDICT_UNRECORDED},
            {"selection": selection.RULE, "verdict": selection.VERDICT})


def damaged_current(metrics: dict, cfg: EvaluateConfig) -> bool:
    """A report that left damaged samples out (or their pictures: `run.damaged_samples`) is current under
    on_damaged=skip only: under "stop" they stop evaluate (or, repaired, are evaluated), where the report would
    pass for one of every sample. on_damaged is hashed as its default: this is where it still counts
    (`schemas.up_to_date.serves_on_damaged`)."""
    return current.serves_on_damaged(cfg.on_damaged, lambda: (metrics.get("run") or {}).get("damaged_samples"))


def nonfinite_current(metrics: dict, cfg: EvaluateConfig) -> bool:
    """A report that left val samples with a non-finite loss out (`loss.nonfinite_samples`) is current under
    on_nonfinite=skip only: under "stop" they stop evaluate, where the report would pass for one of every sample.
    on_nonfinite is hashed as its default: this is where it still counts."""
    return cfg.on_nonfinite == "skip" or not (metrics.get("loss") or {}).get("nonfinite_samples")


def _ema_inputs(c: dict, checkpoints: list[tuple[int, Path]], ema_shas: dict[int, str]) -> tuple[dict, dict]:
    """The EMA's part of `current_metrics`'s inputs, (recorded, present): whether it was scored and is now, each
    scored step's EMA sha256, the best EMA's LoRA (`ema_curve.best_lora_input`). None of them for a run without EMA
    whose report scored none: its inputs as before."""
    ema_recorded = c.get("ema") or {}
    ema_reported = dict(zip(ema_recorded.get("steps") or [], ema_recorded.get("sha256") or []))
    recorded, present = {}, {}
    if ema_recorded or ema_shas:
        recorded["ema_scored"], present["ema_scored"] = bool(ema_recorded), bool(ema_shas)
        if ema_recorded and ema_shas:  # else the line above says it, not every step's sha256 against None
            steps = [str(step) for step, _ in checkpoints if step in ema_reported or step in ema_shas]
            recorded["ema"] = {k: ema_reported.get(int(k)) for k in steps}
            present["ema"] = {k: ema_shas.get(int(k)) for k in steps}
    best_lora = best_lora_input(c.get("best") or {})
    if best_lora is not None:
        recorded["best_ema_lora"], present["best_ema_lora"] = best_lora
    return recorded, present


def named_steps(c: dict) -> list[int]:
    """The steps a report's checkpoints section names: its best, next best and last checkpoint."""
    best = c.get("best") or {}
    points = [best, best.get("runner_up") or {}, c.get("last") or {}]
    return sorted({p["step"] for p in points if isinstance(p.get("step"), int)})


def listed_on_disk(c: dict, named: list[int]) -> list[int]:
    """The steps other than `named` that a report's checkpoints section lists as still on disk (a report from
    before `on_disk` was recorded: every one, as its table shows them)."""
    steps = c.get("steps") or []
    on_disk = c.get("on_disk") or [True] * len(steps)
    return [step for step, here in zip(steps, on_disk) if here and step not in named]


# what a report's recorded inputs are called in the line that says why it is recomputed (`differences`)
_INPUT_LABELS = {"selection": "best checkpoint", "verdict": "differences told apart",
                 "named_on_disk": "checkpoints the report names (best, next best, last) still on disk",
                 "listed_on_disk": "other checkpoints the report lists as on disk still there",
                 "fingerprint": "held-out loss inputs", "steps": "checkpoints in the loss array",
                 "ema_scored": "checkpoints' EMA (train.ema_decay) scored", "ema": "checkpoint EMA weights (sha256)",
                 "best_ema_lora": "the best EMA written as a LoRA (sha256)",
                 "config_fingerprint": "evaluate config fingerprint",
                 "extra_prompts_sha256": "extra prompts' images (sha256)", "loras": "checkpoint weights (sha256)",
                 "paths": "checkpoint paths", "tables": "store tables", "model_fingerprint": "model fingerprint",
                 "lora_sha256": "LoRA weights (sha256)", "evaluation_revision": "evaluation revision"}


def differences(recorded: dict, present: dict, metrics: dict, cfg: EvaluateConfig, settings: dict | None) -> list[str]:
    """What differs between a report (its recorded inputs; `metrics`, its metrics.json) and this run, as train
    says why it trains afresh (`schemas.up_to_date`, one wording): each stale input, then each setting that
    differs - of the loss array's settings (`settings`, this run's: tables, model, the evaluate loss settings,
    the evaluation revision) and of the hashed evaluate settings (the report's `run.config`). Empty when only the
    damaged samples it left out differ (on_damaged, which enters no hash: the stage says so itself)."""
    run = metrics.get("run") or {}
    # checkpoints trained since the report (a resumed run's): named by step, not as each one's sha256 and path
    # against None (a line of 150 characters per checkpoint)
    new = [step for step, sha in present["loras"].items() if sha is not None and recorded["loras"].get(step) is None] \
        if isinstance(present.get("loras"), dict) and isinstance(recorded.get("loras"), dict) else []
    recorded, present = dict(recorded), dict(present)
    for side in (recorded, present):
        for name in ("loras", "paths"):
            if isinstance(side.get(name), dict):
                side[name] = {k: v for k, v in side[name].items() if k not in new}
    found = [f"checkpoints not in the report: step{'s' if len(new) > 1 else ''} {', '.join(new)}"] if new else []
    found += current.stale_named(recorded, present, _INPUT_LABELS)
    if isinstance(run.get("settings"), dict) and settings is not None:
        found += current.changed_settings(run["settings"], settings, "")
    if isinstance(run.get("config"), dict):
        found += current.changed_settings(run["config"], cfg.model_dump(mode="json"), "evaluate",
                                          ignore=unhashed_names(cfg))
    return list(dict.fromkeys(found))


def say_recomputed(out: Path, why: list[str], redone: str = "evaluating again", trained_on: bool = False) -> None:
    """One line: why the report in OUT is computed again (`differences`), and what is (`redone`). `trained_on`:
    the report is this run's from before it trained on (`trained_on_since`): said so, where the line called the
    same run with more checkpoints "not this run's"."""
    if why:
        head = "is this run's from before it trained on" if trained_on else "is not this run's"
        tqdm.write(f"evaluate: the report in {out} {head} ({'; '.join(why)}): {redone}")


def trained_on_since(out: Path, fingerprint: str, checkpoints: list[tuple[int, Path]], shas: dict[int, str]) -> bool:
    """Is OUT's loss array of these settings this run's (`this_runs`: no step of other weights, of another run
    folder or training) with fewer checkpoints than it has now (the run resumed to more steps since)?"""
    if recorded_steps(out, fingerprint) is None:
        return False
    try:
        group = LossGroup(out / GROUP)
        return any(step not in group.steps() for step in shas) and this_runs(group, checkpoints, shas)
    except Exception:  # noqa: BLE001 - unreadable: not known to be this run's, the plain line
        return False


def redone(out: Path, fingerprint: str, checkpoints: list[tuple[int, Path]], shas: dict[int, str],
           settings: dict | None = None, cfg: EvaluateConfig | None = None, earlier: list[dict] = (),
           keys: list[str] | None = None, ranks_machines: list[dict] = ()) -> str:
    """What a report that is not current costs again: the checkpoints whose losses OUT's loss array of these
    settings (`fingerprint`, or a group of them kept aside, which is taken back) lacks; none when only the
    report's own settings changed (num_samples, extra prompts: its pictures), the line said "evaluating again"
    while no checkpoint was; every one when a recorded step holds other weights now (`other_weights`). The line
    said "every checkpoint" where a kept group was taken back (none evaluated), and "1 of 3" where a step
    retrained with other weights set the array aside (all 3 evaluated). Only a seed / σ grid changed (`settings`,
    `cfg`: a group kept aside shares (seed, σ) cells with it, `store.loss_array.cell_donor`): the new cells of
    the checkpoints it holds, as `_plan` computes them (it said "every checkpoint"). `earlier`: the settings'
    earlier spellings, whose kept groups are taken back too (`spelled_as`). `keys`: the val samples the loss
    passes will read (`val_share.loss_keys`): a group of other samples is neither kept in place nor taken back,
    as `LossStore` and `_plan` judge (the line promised a take-back of one, and every checkpoint was evaluated)."""
    spelled = spelled_as(settings, earlier) if settings is not None else None
    axes = Axes(list(keys), [], *cfg.loss_axes) if keys is not None and cfg is not None else None
    if recorded_steps(out, fingerprint) is not None:
        group = LossGroup(out / GROUP)
        if axes is not None and [str(k) for k in group.group["sample"][:]] != axes.keys:
            group = None  # the val samples changed: set aside, nothing taken back (`LossStore`)
    else:  # these settings' group kept aside (settings A, B, then A again): taken back (`LossStore`)
        group = next(iter(kept_groups(out, fingerprint, axes, spelled)), None)
    if group is None:
        return (_grown(out, checkpoints, shas, settings, cfg, keys, ranks_machines)
                or "evaluating every checkpoint again")
    if not this_runs(group, checkpoints, shas):  # as `_plan` decides: aside, and this run's kept group back
        if (back := this_runs_kept(out, fingerprint, checkpoints, shas, axes, spelled)) is not None:
            group = back
        elif other := other_weights(group.steps(), shas):
            return (f"evaluating every checkpoint again (checkpoint step {', '.join(map(str, other))} holds other "
                    f"weights than the losses recorded in {group.path}, which are kept aside)")
        else:
            return f"evaluating every checkpoint again (the losses in {group.path} are another run's, kept aside)"
    where, recorded = group.path, group.steps()
    todo = [step for step, _ in checkpoints if recorded.get(step) != shas[step]]
    # steps pruned since stay on the curve, as the end line counts them ("evaluated 1 of 3 (2 already in ...)")
    n = len([step for step in recorded if step not in todo])
    kept = (f"the losses of {count_text(n, 'checkpoint')} in {where}"
            f"{', taken back,' if where.name != GROUP else ''} kept")
    if not todo:
        return f"writing the report again ({kept}: no checkpoint evaluated again)"
    return f"evaluating {len(todo)} of {count_text(n + len(todo), 'checkpoint')} ({kept})"


def _grown(out: Path, checkpoints: list[tuple[int, Path]], shas: dict[int, str], settings: dict | None,
           cfg: EvaluateConfig | None, keys: list[str] | None, ranks_machines: list[dict] = ()) -> str | None:
    """`redone`'s line when a group kept aside gives these settings' grid some of its (seed, σ) cells; else None.
    The base is not one of them when the base-losses file holds it (`_base_row` reads it from there; its key:
    `ranks_machines`, every rank's machine)."""
    if settings is None or cfg is None:
        return None
    from stages.evaluate import base_losses
    from stages.evaluate.base_images import losses_key

    seeds, sigmas = cfg.loss_axes
    base = keys is None or base_losses.read(out / base_losses.FILE,
                                            losses_key(cfg, settings, list(keys), ranks_machines),
                                            (len(keys), len(seeds), len(sigmas), 3)) is None
    # a new group: the base (unless kept in the file) and every checkpoint
    donor = cell_donor(out, settings, seeds, sigmas, keys, base, {step: shas[step] for step, _ in checkpoints})
    if donor is None:
        return None
    held = sum(1 for step, _ in checkpoints if donor.holds(step, shas[step]))
    rest = len(checkpoints) - held
    return (f"{cells_line(donor.known)} for {'the base and ' if base and donor.has_base() else ''}{held} of "
            f"{count_text(len(checkpoints), 'checkpoint')} (the cells {donor.path} holds reused)"
            + (f", evaluating {rest} other{'s' if rest != 1 else ''} whole" if rest else ""))


def earlier_config_fingerprints(cfg: EvaluateConfig, unset_used: str | None = None) -> list[str]:
    """A report's `config_fingerprint` as recorded before on_damaged and an unread negative_prompt were hashed as
    their defaults (the settings as set; none when that is the present spelling): such a report is current. Also
    as recorded before the attention backend was hashed as resolved, unset, where the report's evidence says its
    unset backend was `cfg`'s (`unset_used`: `stages.evaluate.backend.unset_backend`)."""
    spellings = [cfg]
    if unset_used is not None and unset_used == cfg.attention_backend:
        spellings.append(cfg.model_copy(update={"attention_backend": None}))
    earlier = [settings_hash(hashed_settings(c, as_set=True)) for c in spellings] + \
        [c.fingerprint() for c in spellings[1:]]
    return [h for h in dict.fromkeys(earlier) if h != cfg.fingerprint()]
