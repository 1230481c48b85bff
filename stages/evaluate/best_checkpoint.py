"""Which checkpoint is best, for `evaluate --all-checkpoints`: metrics.json's `loss` and `checkpoints` sections
from the loss array (and the EMA's: `ema_curve`) over the checkpoints still on disk (`summary_held`, `_summary`):
per step overall, per bucket, inside / outside (`step_summaries`); best = the lowest held-out loss over the
selecting half of the val samples (ties: the earlier step, then the raw LoRA); how sure: paired over the other,
confirming half against the base and the next best, and every checkpoint within noise of it (`near_best_steps`).
The halves and why: `stages.evaluate.selection`."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from models.held_out import bucket_of, has_two_regions, loss_summary
from schemas.config import EvaluateConfig
from schemas.errors import UserError
from stages.evaluate.base_images import extra_prompt_bytes
from stages.evaluate.checkpoint_files import checkpoint_gone
from stages.evaluate.checkpoint_load import held_bytes
from stages.evaluate.ema_curve import label as ema_label
from stages.evaluate.paired import within_noise
from stages.evaluate.selection import pick_and_confirm, verdict
from store.loss_array import LossStore


def summary_held(losses: LossStore, samples, cfg: EvaluateConfig, fingerprint: str,
                 on_disk: list[tuple[int, Path]], shas: dict[int, str], pictured: bool, ema: tuple | None = None):
    """`_summary` over the checkpoints still on disk, and the bytes of the best and last it names (`held_bytes`;
    read when no picture is made too, not held then: not `pictured`); one of them pruned before it was read: the
    summary again without it. (None, None): none left. `ema`: (the EMA group, step -> EMA sha256), summarised
    beside. The best and last named are their recorded bytes either way (`held_bytes` refuses a rewritten one):
    without pictures a best rewritten after its losses (a training restarted into RUN beside evaluate) was named
    by its path, which held other weights than the numbers are of."""
    ema_losses, ema_shas = ema if ema is not None else (None, {})
    while True:
        summary = _summary(losses, samples, cfg, fingerprint, on_disk, ema_losses)
        if summary is None:
            return None, None
        _, best, last = summary
        held = held_bytes([best, last], shas, ema_shas)
        if held is not None:
            return summary, held if pictured else {}
        on_disk = [c for c in on_disk if not checkpoint_gone(c[1])]


def _summary(losses: LossStore, samples, cfg: EvaluateConfig, fingerprint: str,
             checkpoints: list[tuple[int, Path]], ema: LossStore | None = None) -> tuple[dict, dict, dict] | None:
    """metrics.json's loss and checkpoints sections, the best and the last checkpoint still on disk; None when no
    checkpoint recorded is still on disk.

    "Still on disk" = among `checkpoints` (the run's kept ones now, named by their present paths): a checkpoint
    pruned since keeps its point on the curves; a run folder moved since keeps its numbers (same bytes).

    A val sample whose base loss is non-finite has bad stored features: evaluate.on_nonfinite stops naming it
    (or leaves it out of every number). A checkpoint with a non-finite loss is simply never the best.

    `ema`: the EMA group (`ema_curve`): its curve beside the raw one (`checkpoints.ema`), and the best picked among
    both (a tie: the earlier step, then the raw LoRA), `best.weights` saying which ("lora" or "ema")."""
    from stages.evaluate.loss_section import finite_samples

    steps, paths, grids = losses.losses()
    present = {step: str(Path(path).resolve()) for step, path in checkpoints}
    paths = [present.get(step, p) for step, p in zip(steps, paths)]
    base = losses.base()
    kept, nonfinite = finite_samples(samples, {"base": base}, cfg)
    base, grids, samples = base[kept], grids[:, kept], [samples[i] for i in kept]
    per_step = step_summaries(base, grids, [bucket_of(s) for s in samples], [has_two_regions(s) for s in samples])
    alive = [i for i, step in enumerate(steps) if step in present and Path(present[step]).exists()]  # pruned meanwhile
    if not alive:  # every one evaluated was pruned meanwhile: the caller evaluates newer ones, or says so
        return None
    points = [{"step": step, "path": path, "loss": numbers["overall"]}
              for step, path, numbers in zip(steps, paths, per_step["steps"])]
    curve = _ema_curve(ema, kept, base, samples, present) if ema is not None else None
    points, candidates, all_grids = _with_ema(points, alive, grids, curve)
    picked = _best_of(samples, base, points, candidates, all_grids, losses.path)
    best_i = picked["best"]
    loss = _loss_section(cfg, samples, base, all_grids[best_i], nonfinite)

    best = {**_best(points, picked), "weights": points[best_i].get("weights", "lora")}
    best["within_noise"] = _note_vs_best(points, picked, candidates,
                                         per_step["steps"] + (curve["section"]["per_step"] if curve else []))
    loss["lora_minus_base"] = best["vs_base"]  # the confirmed difference, as the summary states it
    last = points[alive[-1]]
    metrics = {"loss": loss,
               "checkpoints": _checkpoints_section(losses, cfg, fingerprint, steps, paths, alive, per_step, best, last,
                                                       curve)}
    metrics["checkpoints"]["selection"] = picked["record"]
    return metrics, best, dict(last)  # a dict apart from metrics' "last"


def _best_of(samples, base: np.ndarray, points: list[dict], candidates: list[int], grids: np.ndarray,
             where: Path) -> dict:
    """`selection.pick_and_confirm` over the points: the best picked on the selecting half of the val samples,
    what is stated of it paired over the confirming half; none finite: one line naming the loss array (`where`)."""
    picked = pick_and_confirm([s.key for s in samples], base, grids, [p["step"] for p in points],
                              [p["loss"] for p in points], candidates)
    if picked is None:
        raise UserError(f"no checkpoint in {where} has a finite held-out loss; check the run's training loss")
    return picked


def _loss_section(cfg: EvaluateConfig, samples, base: np.ndarray, best: np.ndarray, nonfinite) -> dict:
    """metrics.json's `loss`, as a single-LoRA report's: the base against the best checkpoint's grid (`best`), over
    the val samples kept, and those left out for a non-finite base loss."""
    from stages.evaluate.loss_section import protocol as single_protocol

    protocol = single_protocol(cfg, samples).replace("LoRA off (base) and on", "LoRA off (base) and the best checkpoint")
    loss = loss_summary({"base": base, "lora": best}, samples, *cfg.loss_axes, protocol)
    loss["nonfinite_samples"] = nonfinite  # left out of every number (evaluate.on_nonfinite=skip)
    return loss


def _checkpoints_section(losses: LossStore, cfg: EvaluateConfig, fingerprint: str, steps: list[int], paths: list[str],
                         alive: list[int], per_step: dict, best: dict, last: dict, curve: dict | None) -> dict:
    """metrics.json's `checkpoints`: every step's numbers, path and bytes, which are still on disk, the best and
    the last, and the EMA's curve (`curve`) where it was scored."""
    shas = losses.steps()  # step -> the LoRA bytes its numbers are of
    section = {
        "losses": str(losses.path), "fingerprint": fingerprint, "config_fingerprint": cfg.fingerprint(),
        # None without extra prompts: a report made before they were hashed stays current
        "extra_prompts_sha256": extra_prompt_bytes(cfg) or None,
        # the bytes each step's numbers are of: what the up-to-date check compares (`current_metrics`)
        "steps": steps, "paths": paths, "lora_sha256": [shas[step] for step in steps],
        # whether each step's checkpoint was still there (a pruned one keeps its point, but not its file)
        "on_disk": [i in alive for i in range(len(steps))],
        "base": per_step["base"], "per_step": per_step["steps"],
        "best": best, "last": last,
        "note": BEST_NOTE + (EMA_NOTE if curve is not None else ""),
    }
    if curve is not None:
        section["ema"] = curve["section"]
    return section


BEST_NOTE = ("best = lowest held-out loss over the selecting half of the val samples (checkpoints.selection: "
             "selected_on), among the checkpoints still on disk (ties: earlier step); best.vs_base, best.runner_up and "
             "each step's vs_best: differences paired over the other, confirming half (confirmed_on; same noise and "
             "σ) ± their standard error, free of the optimism of stating the winner's own numbers; within about two "
             "standard errors (more over few samples: Student's t, checkpoints.selection.verdict) this held-out set "
             "does not tell the two apart")


EMA_NOTE = ("; each checkpoint's EMA (train.ema_decay) is scored on the same val samples, noise and σ, and competes "
            "for best (best.weights: lora or ema; a tie goes to the raw LoRA)")


def step_summaries(base: np.ndarray, grids: np.ndarray, samples_meta: list[str], two_regions: list[bool]) -> dict:
    """Per step: overall, per bucket, inside / outside (means over rows; a sample weighs its seeds x σ rows);
    and the base's same numbers. samples_meta: each sample's bucket; two_regions: whether its mask has an inside
    and an outside (only those have inside / outside losses; the others hold NaN there by design)."""
    buckets = sorted(set(samples_meta), key=lambda b: tuple(int(x) for x in b.split("x")))
    idx = {b: [i for i, m in enumerate(samples_meta) if m == b] for b in buckets}
    masked = [i for i, two in enumerate(two_regions) if two]

    def numbers(g: np.ndarray) -> dict:
        # No non-finite value is left out here: a checkpoint that overflows on some samples has a non-finite
        # loss (never the best), not the mean of the samples it did not overflow on.
        def mean(a: np.ndarray) -> float:
            return float(a.mean()) if a.size else math.nan

        return {
            "overall": mean(g[..., 0]),
            "per_bucket": {b: mean(g[ix, ..., 0]) for b, ix in idx.items()},
            "inside": mean(g[masked, ..., 1]),
            "outside": mean(g[masked, ..., 2]),
        }

    return {"base": numbers(base), "steps": [numbers(g) for g in grids]}


def _with_ema(points: list[dict], alive: list[int], grids: np.ndarray,
              curve: dict | None) -> tuple[list[dict], list[int], np.ndarray]:
    """(points, the indexes of those that may be the best, their grids) with the EMA curve's after the raw ones: a
    tie at one step goes to the raw LoRA (a stable pick)."""
    if curve is None:
        return points, list(alive), grids
    candidates = list(alive) + [len(points) + i for i in curve["alive"]]
    all_grids = np.concatenate([grids, curve["grids"]]) if len(curve["points"]) else grids
    return points + curve["points"], candidates, all_grids


def _ema_curve(ema: LossStore, kept, base: np.ndarray, samples, present: dict[int, str]) -> dict:
    """The EMA group's curve over the val samples `kept` (those the raw summary keeps): its points (`weights`
    "ema", the EMA file's path), its grids, which are still on disk, and metrics.json's `checkpoints.ema`."""
    from models.ema_file import ema_of

    steps, paths, grids = ema.losses()
    shas = ema.steps()
    here = {step: str(ema_of(path).resolve()) for step, path in present.items()}
    paths = [here.get(step, p) for step, p in zip(steps, paths)]
    grids = grids[:, kept]
    per_step = step_summaries(base, grids, [bucket_of(s) for s in samples],
                              [has_two_regions(s) for s in samples])["steps"]
    alive = [i for i, step in enumerate(steps) if step in here and Path(here[step]).exists()]
    points = [{"step": step, "path": path, "loss": p["overall"], "weights": "ema"}
              for step, path, p in zip(steps, paths, per_step)]
    section = {"losses": str(ema.path), "steps": steps, "paths": paths, "sha256": [shas[step] for step in steps],
               "on_disk": [i in alive for i in range(len(steps))], "per_step": per_step}
    return {"points": points, "grids": grids, "alive": alive, "section": section}


def _note_vs_best(points: list[dict], picked: dict, alive: list[int], per_step: list[dict]) -> list[dict]:
    """Each step's `vs_best` (its loss minus the best's, paired over the confirming val samples ± s.e.) and its
    loss over the selecting ones (`selecting`: what picked the best) into `per_step[i]` (`points[i]`'s numbers,
    the raw curve's then the EMA's); and the checkpoints still on disk within noise of the best, [{step,
    weights}]. The runner-up alone did not say it: the next best may be told apart (+0.010 ± 0.001) while a later
    one (+0.020 ± 0.030) is not, and "best" was read as settled."""
    diffs = picked["vs_best"]
    for numbers, diff, selecting in zip(per_step, diffs, picked["selecting"]):
        numbers["vs_best"] = diff
        numbers["selecting"] = selecting if math.isfinite(selecting) else None  # strict JSON: no NaN
    return [{"step": points[i]["step"], "weights": points[i].get("weights", "lora")}
            for i in sorted(alive, key=lambda i: (points[i]["step"], i)) if within_noise(diffs[i])]


def _best(points: list[dict], picked: dict) -> dict:
    """The best checkpoint's point (step, path, overall loss over every val sample) and how sure "best" is:
    paired over the confirming val samples against the base (`vs_base`, and what it says: `verdict`) and the
    next best checkpoint still on disk by the selecting samples (`runner_up`: runner-up minus best)."""
    best_i, nxt = picked["best"], picked["runner_up"]
    best = {**points[best_i], "vs_base": picked["vs_base"], "verdict": verdict(picked["vs_base"])}
    if nxt is not None:
        best["runner_up"] = {**points[nxt], "weights": points[nxt].get("weights", "lora"), **picked["vs_best"][nxt]}
    return best


def near_best_steps(best: dict, scored_ema: bool) -> list[str]:
    """['step 30', 'step 40 (EMA)']: the checkpoints still on disk within noise of the best (`within_noise`; none
    in a report written before it)."""
    return [f"step {p['step']}{ema_label(p, scored_ema)}" for p in best.get("within_noise") or []]
