"""`pipeline compare`: several runs' held-out loss curves and best points on one page, plus a CSV.

Each input is a report folder (holding `losses.zarr`, written by `evaluate --all-checkpoints` or `run all`) or a
run folder whose report was kept inside it (`RUN/evaluate-report/`). Runs are comparable only on the same
held-out set: the same store `text` / `vae` table versions, the same val sample keys, noise seeds and σ grid,
measured the same way (base model, and evaluate's dtype, LoRA scale, quantised base, attention backend);
anything else is refused with the difference named (numbers of different held-out sets are not one scale).

A report of a run trained with an EMA (`REPORT/ema-losses/losses.zarr`, stages/evaluate/ema_curve.py) adds its EMA
curve beside the raw one, and its best is picked among both by the report's rule, so compare names the best the
report names (step and weights).
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from schemas.errors import UserError
from stages.evaluate.backend import as_resolved
from stages.evaluate.curves import Chart, Series, pick_best, svg
from store.loss_array import GROUP, open_dataset

KEPT_REPORT = "evaluate-report"  # where `run all` moves a kept run's report (pipeline/orchestrate.py)


@dataclass
class EmaCurve:
    """A report's EMA curve (`ema_curve`): each checkpoint's EMA file over the raw curve's samples and base."""
    steps: list[int]
    checkpoints: list[str]  # the EMA files
    overall: list[float]
    inside: list[float]
    outside: list[float]
    on_disk: list[bool | None]
    per_sample: np.ndarray  # [step, sample]: each sample's loss (mean over seeds x σ, region all), for `paired`
    sha256: list[str] | None = None  # each EMA file's bytes the numbers are of


@dataclass
class RunCurves:
    label: str
    group: Path
    steps: list[int]
    checkpoints: list[str]
    overall: list[float]
    inside: list[float]
    outside: list[float]
    base: dict[str, float]  # region -> base loss
    held_out: dict  # what makes two held-out sets the same
    on_disk: list[bool | None]  # whether each step's checkpoint is still there (None: a validation step, no file)
    # the table version ids the losses were read from (None: unknown): compared when the "store tables" of two
    # arrays are spelled differently (one by content, `JoinedTables.content_names`; one by version ids, as
    # earlier releases' reports and validation curves record them)
    table_versions: dict | None = None
    # how the numbers were computed (`_measured`: precision, quantised base, attention backend, LoRA scale), for an
    # evaluate array from its settings, for a validation curve from what train recorded beside them; None: unknown
    measured: dict | None = None
    ema: EmaCurve | None = None  # a run trained with train.ema_decay, its report scoring each checkpoint's EMA
    # [step, sample]: each sample's loss (mean over seeds x σ, region all), and [sample] the samples the curve's
    # numbers are over (`_kept`): each run's best paired with the best run's (`paired_to_best`)
    per_sample: np.ndarray | None = None
    kept: np.ndarray | None = None
    sha256: list[str] | None = None  # each step's LoRA bytes the numbers are of (the array's lora_sha256)

    @property
    def best(self) -> tuple[str, int] | None:
        """(weights: "lora" or "ema", index into that curve) by the report's rule
        (stages/evaluate/best_checkpoint.py `_summary`, `selection.pick_and_confirm`): the lowest loss over the
        selecting half of the val samples among the checkpoints still on disk whose overall loss is finite, raw
        LoRAs and EMAs alike (a tie: the earlier step, then the raw LoRA); a pruned one keeps its point on the
        curve but is never named. A report looked at away from its run (copied, none of its checkpoints here)
        names its curves' minimum by the same rule."""
        points = [("lora", i, self.steps[i], self.overall[i], self.on_disk[i]) for i in range(len(self.steps))]
        if self.ema is not None:  # after the raw points: pick_best's stable sort gives a tie to the raw LoRA
            e = self.ema
            points += [("ema", i, e.steps[i], e.overall[i], e.on_disk[i]) for i in range(len(e.steps))]
        rows = [p for p in points if p[4] is not False] or points
        best = pick_best([p[2] for p in rows], self._selecting(rows))
        return None if best is None else rows[best][:2]

    def _selecting(self, rows: list[tuple]) -> list[float]:
        """Each candidate point's loss over the selecting half of the samples the numbers are over
        (`selection.split`); the overall loss where no per-sample losses are read."""
        halves = self.halves(len(rows))
        if halves is None:
            return [p[3] for p in rows]
        curves = {"lora": self.per_sample, "ema": self.ema.per_sample if self.ema is not None else None}
        return [float(curves[w][i][halves[0]].mean()) if math.isfinite(loss) else math.nan
                for w, i, _, loss, _ in rows]

    def halves(self, candidates: int) -> tuple[np.ndarray, str] | None:
        """([sample] bool: the samples that pick this run's best among `candidates` points, how:
        `selection.split` over the samples its numbers are over, `kept`); None where no per-sample losses are
        read."""
        from stages.evaluate.selection import split

        if self.per_sample is None or self.kept is None:
            return None
        keys = [k for k, here in zip(self.held_out["val samples"], self.kept) if here]
        select, _, how = split(keys, candidates)
        out = np.zeros(self.kept.size, dtype=bool)
        out[np.flatnonzero(self.kept)] = select
        return out, how

    def point(self, weights: str, i: int) -> dict:
        """One point of the raw curve ("lora") or the EMA's: step, checkpoint, loss, on_disk."""
        c = self if weights == "lora" else self.ema
        return {"step": c.steps[i], "checkpoint": c.checkpoints[i], "loss": c.overall[i], "on_disk": c.on_disk[i],
                "weights": weights}

    @property
    def best_point(self) -> dict | None:
        return None if (b := self.best) is None else self.point(*b)

    def best_per_sample(self) -> np.ndarray | None:
        """[sample] the best point's per-sample losses (NaN where the curve's numbers leave a sample out)."""
        if (b := self.best) is None or self.per_sample is None:
            return None
        values = (self if b[0] == "lora" else self.ema).per_sample[b[1]]
        return np.where(self.kept, values, np.nan)


def find_group(path: str | Path) -> Path:
    p = Path(path)
    for candidate in (p / GROUP, p / KEPT_REPORT / GROUP, p if p.name.endswith(".zarr") else None):
        if candidate is not None and (candidate / "zarr.json").is_file():
            return candidate
    if not p.exists():  # a mistyped path: said as such, not as a folder missing its losses
        raise UserError(f"{p} does not exist; pass a report folder written by `pipeline run evaluate "
                        "--all-checkpoints` or `pipeline run all`, or a run folder holding one")
    raise UserError(f"{p}: no {GROUP} there (nor in {p / KEPT_REPORT}); pass a report folder written by "
                    "`pipeline run evaluate --all-checkpoints` or `pipeline run all`, or a run folder holding one")


def _mean(a: np.ndarray) -> float:
    """Non-finite values included: a checkpoint that overflows on some samples has no finite loss (never the best),
    not the mean of the samples it did not overflow on. The rows left out by design are left out by `_kept`."""
    return float(a.mean()) if a.size else math.nan


def _kept(reference: np.ndarray) -> np.ndarray:
    """[sample] bool: a sample whose reference losses (the base's; a region's) are all finite. A non-finite base
    loss marks bad stored features (evaluate stops, or with on_nonfinite=skip leaves the sample out of every
    number); NaN inside / outside marks a sample without a two-region mask."""
    return np.isfinite(reference).reshape(len(reference), -1).all(axis=1)


def _on_disk(checkpoints: list[str]) -> list[bool | None]:
    """evaluate records each checkpoint's file; validation while training a label ("training step N"): None."""
    return [Path(c).exists() if Path(c).is_absolute() else None for c in checkpoints]


def _ema_curve(group: Path, samples: list[str], kept: np.ndarray, two: np.ndarray, r: dict,
               report: dict | None) -> EmaCurve | None:
    """The EMA group beside a report's raw one (REPORT/ema-losses/losses.zarr), over the raw curve's samples (its
    base is the raw array's: `best_checkpoint._ema_curve` keeps the raw summary's samples); None where there is none,
    or where the report beside it (`report`, its metrics.json) scores no EMA (`checkpoints.ema`): a report written
    again with evaluate.score_ema off, or of a run without EMA into the folder of one with, leaves the group on
    disk."""
    from tqdm.auto import tqdm

    from stages.evaluate.ema_curve import FOLDER

    path = group.parent / FOLDER / GROUP
    try:
        scored = "ema" in report["checkpoints"]
    except (KeyError, TypeError):  # no report beside the array (a validation curve): none
        scored = False
    if not scored or not (path / "zarr.json").is_file():
        return None
    ds = open_dataset(path, say=tqdm.write)
    if [str(k) for k in ds.sample.values] != samples:
        raise UserError(f"{path}: its val samples are not those of {group} beside it; evaluate the run again "
                        "(`pipeline run evaluate --all-checkpoints`) to write both anew")
    loss = ds.loss.values.astype(np.float64)
    steps = [int(s) for s in ds.step.values]
    checkpoints = _in_run(group, steps, [str(c) for c in ds.checkpoint.values])
    return EmaCurve(steps=steps, checkpoints=checkpoints, sha256=[str(h) for h in ds.lora_sha256.values],
                    overall=[_mean(g[kept, ..., r["all"]]) for g in loss],
                    inside=[_mean(g[two, ..., r["inside"]]) for g in loss],
                    outside=[_mean(g[two, ..., r["outside"]]) for g in loss], on_disk=_on_disk(checkpoints),
                    per_sample=_per_sample(loss, r))


def read_curves(path: str | Path, label: str) -> RunCurves:
    group = find_group(path)
    from tqdm.auto import tqdm

    ds = open_dataset(group, say=tqdm.write)  # in step order; an array of an earlier release lacking a chunk: a line
    report = _report_beside(group)
    settings = dict(ds.attrs.get("settings", {}))
    if isinstance(settings.get("evaluate"), dict):  # an unset backend recorded before it was hashed as resolved
        settings["evaluate"] = as_resolved(settings["evaluate"], report, dict(ds.attrs.get("settings", {})))
        # seeds and σ are sets of rows (schemas/config.py `_A_SET_OF_ROWS`): recorded in another order, the same
        settings["evaluate"] = {k: sorted(v) if k in ("noise_seeds", "timesteps") and isinstance(v, list) else v
                                for k, v in settings["evaluate"].items()}
    loss = ds.loss.values.astype(np.float64)  # [step, sample, seed, sigma, region]
    base = ds.base_loss.values.astype(np.float64) if "base_loss" in ds else np.full(loss.shape[1:], np.nan)
    regions = [str(r) for r in ds.region.values]
    r = {name: regions.index(name) for name in ("all", "inside", "outside")}
    # the samples evaluate's numbers are over (stages/evaluate/best_checkpoint.py `_summary`); without a base, all
    kept = _kept(base[..., r["all"]]) if "base_loss" in ds else np.ones(loss.shape[1], dtype=bool)
    two = kept & (_kept(base[..., r["inside"]]) if "base_loss" in ds else np.isfinite(loss[..., r["inside"]]).any(
        axis=tuple(i for i in range(loss.ndim - 1) if i != 1)))
    steps = [int(s) for s in ds.step.values]
    checkpoints = _in_run(group, steps, [str(c) for c in ds.checkpoint.values])
    curves = RunCurves(
        label=label, group=group, steps=steps, checkpoints=checkpoints,
        on_disk=_on_disk(checkpoints),
        overall=[_mean(g[kept, ..., r["all"]]) for g in loss], inside=[_mean(g[two, ..., r["inside"]]) for g in loss],
        outside=[_mean(g[two, ..., r["outside"]]) for g in loss],
        base={"all": _mean(base[kept, ..., r["all"]]), "inside": _mean(base[two, ..., r["inside"]]),
              "outside": _mean(base[two, ..., r["outside"]])},
        held_out={
            "store tables": settings.get("tables"),
            "val samples": [str(k) for k in ds.sample.values],
            "noise seeds": sorted(int(s) for s in ds.seed.values),  # the array's order is layout (`_A_SET_OF_ROWS`)
            "σ grid": sorted(float(s) for s in ds.sigma.values),
            # the same samples through another base model, dtype, LoRA scale or quantised base are not one scale
            "base model": settings.get("model_fingerprint"),
            # not on_damaged nor max_loss_samples: the samples they leave read are the val samples, compared above
            # (arrays recorded on_damaged as set; a cap at or above the split's size is recorded as null now, as
            # set before: one held-out set, `loss_fingerprint.samples_read`)
            "evaluate settings": settings.get("evaluate") and {k: v for k, v in settings["evaluate"].items()
                                                                if k not in ("on_damaged", "max_loss_samples")},
            # what evaluate computes from the same inputs (`loss_fingerprint.EVALUATION_REVISION`; recorded before it
            # was: revision 1): another revision's numbers are not one scale with these
            "evaluation revision": _revision(settings),
        },
        table_versions=_table_versions(settings, dict(ds.attrs)),
        measured=_measured(settings, dict(ds.attrs), group.parent),
        ema=_ema_curve(group, [str(k) for k in ds.sample.values], kept, two, r, report),
        per_sample=_per_sample(loss, r), kept=kept, sha256=[str(h) for h in ds.lora_sha256.values],
    )
    _best_on_disk(curves)
    return curves


def _report_beside(group: Path) -> dict | None:
    """The metrics.json of the report holding GROUP (None for a validation curve: no report beside it): which
    backend an unset one was and whether an EMA curve is the report's. A damaged one is refused in one line, not
    read as absent (its EMA curve silently left out) nor taken as it reads."""
    from stages.evaluate.report import checked_metrics

    return checked_metrics(group.parent, "evaluate its run again (`pipeline run evaluate --all-checkpoints "
                           f"--out {group.parent}`)", missing_ok=True)


def _in_run(group: Path, steps: list[int], checkpoints: list[str]) -> list[str]:
    """The recorded checkpoint paths, where the report is a kept run's (RUN.previous/N/evaluate-report: `run all`
    moved the report into the run, then the run aside) each found in that run: RUN/checkpoints/step-N/... The
    recorded paths are where the run was, where a new run's checkpoints of the same steps are now."""
    if group.parent.name != KEPT_REPORT:
        return checkpoints
    run = group.parent.parent / "checkpoints"
    out = []
    for step, recorded in zip(steps, checkpoints):
        parts = Path(recorded).parts
        at = [i for i, part in enumerate(parts) if part == f"step-{step}"]
        here = run.joinpath(f"step-{step}", *parts[at[-1] + 1:]) if at and Path(recorded).is_absolute() else None
        out.append(str(here.resolve()) if here is not None and here.exists() else recorded)
    return out


def _best_on_disk(r: RunCurves) -> None:
    """The best named (`RunCurves.best`) only where its file holds the bytes its numbers are of (the recorded
    sha256): a path holding other weights (a new run trained into the folder, a checkpoint rewritten) is marked
    not on disk and the best picked again. One file read per run where the best is its own; a validation step
    names no file; none when it is unchanged since it was hashed (`models.file_hashes`)."""
    from stages.evaluate.lora_bytes import remembered_sha256

    while (b := r.best) is not None:
        c = r if b[0] == "lora" else r.ema
        if c.on_disk[b[1]] is not True or c.sha256 is None:
            return
        try:
            same = remembered_sha256(_weights(c.checkpoints[b[1]])) == c.sha256[b[1]]
        except OSError:
            same = False
        if same:
            return
        c.on_disk[b[1]] = False


def _weights(checkpoint: str) -> Path:
    """A recorded checkpoint's weight file: its LoRA folder's (RUN/checkpoints/step-N/lora), or the file itself (an
    EMA file, step-N/ema.safetensors)."""
    from models.lora_files import WEIGHT_NAME

    path = Path(checkpoint)
    return path / WEIGHT_NAME if path.is_dir() else path


def _per_sample(loss: np.ndarray, r: dict) -> np.ndarray:
    """[step, sample] of a [step, sample, seed, σ, region] array: a sample's seeds x σ rows averaged (`paired`)."""
    return loss[..., r["all"]].mean(axis=(2, 3)) if loss.size else np.zeros(loss.shape[:2])


def paired_to_best(runs: list[RunCurves]) -> list[dict | None]:
    """Per run, its best point minus the best run's best, paired over the val samples both curves' numbers hold
    that picked neither best (`selection`: each run's best is picked on the selecting half, so the confirming
    half states it without the winner's optimism), ± its standard error (`stages.evaluate.paired`, as evaluate
    states its best checkpoint against the next best): None for the best run itself and a run without a finite
    best. The best run: the lowest best loss over one set of samples for every run (`_run_pick`: those that
    picked the runs' bests; a tie: the first given), as evaluate picks a checkpoint. Every run is measured on
    one held-out set (`check_same_held_out`: the same samples, noise and σ), so the runs differ sample by sample
    by their weights alone."""
    from stages.evaluate.paired import paired

    values = [r.best_per_sample() for r in runs]
    spent = [_spent(r, v) for r, v in zip(runs, values)]
    losses = _run_pick(runs, values, spent)
    if not any(math.isfinite(x) for x in losses):
        return [None] * len(runs)
    top = losses.index(min(losses))
    out: list[dict | None] = []
    for i, v in enumerate(values):
        if i == top or v is None or not math.isfinite(losses[i]):
            out.append(None)
            continue
        both = np.isfinite(v) & np.isfinite(values[top]) & ~spent[i] & ~spent[top]
        out.append({"run": runs[top].label, **paired(v[both], values[top][both])})
    return out


def _run_pick(runs: list[RunCurves], values: list[np.ndarray | None],
              spent: list[np.ndarray]) -> list[float]:
    """Each run's best loss the best run is picked on (inf without a finite best), every run's over the same
    samples: those every run with a finite best holds that picked some run's best (`spent`: each run's selecting
    half; all of them where no run's pick spent any). A run of one checkpoint picked its best on no sample: its
    loss over every sample beside another run's over its selecting half compared two sample sets, not two runs.
    Without per-sample losses: each best's overall loss."""
    finite = [r.best_point is not None and math.isfinite(r.best_point["loss"]) for r in runs]
    if any(f and v is None for f, v in zip(finite, values)):
        return [r.best_point["loss"] if f else math.inf for r, f in zip(runs, finite)]
    held = [i for i, f in enumerate(finite) if f]
    if not held:
        return [math.inf] * len(runs)
    common = np.logical_and.reduce([np.isfinite(values[i]) for i in held])
    chose = common & np.logical_or.reduce([spent[i] for i in held])
    chose = chose if chose.any() else common
    return [float(values[i][chose].mean()) if finite[i] else math.inf for i in range(len(runs))]


def _spent(r: RunCurves, values: np.ndarray | None) -> np.ndarray:
    """[sample] the samples a run's pick of its best spent (its selecting half); none where no halves were made
    (one candidate, too few samples) or no per-sample losses are read."""
    from stages.evaluate.selection import SPLIT

    if values is None:
        return np.zeros(0, dtype=bool)
    points = [*r.on_disk, *(r.ema.on_disk if r.ema is not None else [])]
    halves = r.halves(sum(here is not False for here in points) or len(points))  # `best`'s candidates
    if halves is None or halves[1] != SPLIT:
        return np.zeros(values.size, dtype=bool)
    return halves[0]


def _revision(settings: dict) -> int | None:
    """The evaluation revision an evaluate array's numbers are of; None for a validation curve (train's, which
    records none: compared as before)."""
    from schemas.up_to_date import UNRECORDED_REVISION

    if not isinstance(settings.get("evaluate"), dict):
        return None
    return settings.get("evaluation_revision", UNRECORDED_REVISION)


def _measured(settings: dict, attrs: dict, folder: Path | None = None) -> dict | None:
    """One spelling of how an array's losses were computed, for evaluate arrays (`settings["evaluate"]`) and
    validation curves (`attrs["measured"]`, stages/train/val_curve.py) alike, so a validation curve is compared
    with a report too; None for a curve recorded before train noted it (comparable as before). The attention
    backend is the one resolved: a curve recorded unset (before train recorded it resolved) reads the one its run
    used from FOLDER/attention.json (the run folder), as train's reuse does."""
    evaluate, train = settings.get("evaluate"), attrs.get("measured")
    if isinstance(evaluate, dict):
        return {"precision": evaluate.get("dtype"), "quantize_base": evaluate.get("quantize_base", "none"),
                "attention_backend": evaluate.get("attention_backend"), "lora_scale": evaluate.get("lora_scale", 1.0)}
    if isinstance(train, dict):
        return {"precision": _validation_precision(train), "quantize_base": train.get("quantize_base", "none"),
                "attention_backend": train.get("attention_backend") or _run_backend(folder), "lora_scale": 1.0}
    return None


def _validation_precision(measured: dict) -> str:
    """What a validation curve was computed in, from train's `measured` note: validation runs outside the step's
    autocast (stages/train/validate.py `untouched`), so `mixed_precision` changes none of its numbers. A float32
    base's curve is evaluate's float32 measurement; a bf16 base's is not evaluate's bf16, its LoRA held in float32
    (evaluate's adapter is built in the base's dtype)."""
    dtype = measured.get("dtype")
    return dtype if dtype == "float32" else f"{dtype} base, float32 LoRA"


def _run_backend(run_dir: Path | None) -> str | None:
    """The backend RUN/attention.json names (the run's latest start; stages/train/recipe.py), or None."""
    from schemas.record_formats import ATTENTION_JSON

    try:
        used = json.loads((Path(run_dir) / ATTENTION_JSON).read_text()).get("backend") if run_dir else None
    except (OSError, ValueError, AttributeError):
        return None
    return used if isinstance(used, str) else None


def _table_versions(settings: dict, attrs: dict) -> dict | None:
    """The version ids an array's losses were read from: recorded beside settings that name the tables by content
    (`LossStore.note_versions`), else the settings' own tables when they name them by version ids."""
    if isinstance(attrs.get("table_versions"), dict):
        return attrs["table_versions"]
    tables = settings.get("tables")
    if isinstance(tables, dict) and not any(str(v).startswith("content:") for v in tables.values()):
        return tables
    return None


def check_same_held_out(runs: list[RunCurves]) -> None:
    """Refuse runs evaluated on different held-out sets, naming what differs and where."""
    first = runs[0]
    for other in runs[1:]:
        for what, value in first.held_out.items():
            theirs = other.held_out[what]
            if what in ("evaluate settings", "evaluation revision") and (value is None or theirs is None):
                continue  # validation while training records none (RUN/losses.zarr): comparable as before
            if what == "store tables" and theirs != value and first.table_versions is not None and \
                    first.table_versions == other.table_versions:
                continue  # one names the tables by content, the other by version ids: the same versions read
            if theirs != value:
                detail = ""
                if what == "val samples":
                    a, b = set(value), set(theirs)
                    detail = f" ({len(a - b)} only in the first, {len(b - a)} only in the other)"
                elif what in ("store tables", "base model", "evaluation revision"):
                    detail = f" ({value} vs {theirs})"
                elif what == "evaluate settings":
                    keys = sorted(k for k in {*value, *theirs} if value.get(k) != theirs.get(k))
                    detail = " (" + ", ".join(f"{k}: {value.get(k)} vs {theirs.get(k)}" for k in keys) + ")"
                raise UserError(
                    f"cannot compare {first.group} and {other.group}: their held-out sets differ in {what}{detail}; "
                    "compare runs evaluated on the same store version and val split with the same evaluate settings"
                )
        if first.measured is not None and other.measured is not None and first.measured != other.measured:
            # a validation curve (train's precision, quantised base, attention backend) against another curve or
            # a report: not one scale, as two reports of another evaluate.dtype are not
            a, b = first.measured, other.measured
            detail = ", ".join(f"{k}: {a.get(k)} vs {b.get(k)}" for k in sorted({*a, *b}) if a.get(k) != b.get(k))
            raise UserError(
                f"cannot compare {first.group} and {other.group}: their losses were measured differently ({detail}); "
                "compare runs validated or evaluated in the same precision, quantisation and attention backend "
                "(evaluate both runs' checkpoints with the same evaluate settings: `pipeline run evaluate "
                "--all-checkpoints`)"
            )


def labels_for(paths: list[str]) -> list[str]:
    """Each input's folder name; the full path where two names collide."""
    names = [Path(p).resolve().name for p in paths]
    return [n if names.count(n) == 1 else str(Path(p).resolve()) for n, p in zip(names, paths)]


COMPARE_FILES = ("index.html", "curves.csv")


def refuse_other_files(out: Path) -> None:
    """OUT new, empty or an earlier comparison's: `--out REPORT` replaced an evaluate report's index.html (and
    `--out STORE` put pages into a store) without a word."""
    if not out.is_dir():
        return
    other = sorted(p.name for p in out.iterdir() if p.name not in COMPARE_FILES and not p.name.startswith("."))
    if other:
        raise UserError(f"--out {out} holds other files ({', '.join(other[:3])}{', ...' if len(other) > 3 else ''}): "
                        f"compare writes {' and '.join(COMPARE_FILES)} there; pass a new or empty folder, or the "
                        "folder of an earlier compare")


def given_twice(paths: list[str], keys: list) -> str | None:
    """What is wrong when two of `paths` have equal `keys` (their resolved folders: the CLI, before any lookup; the
    loss groups they lead to: `write_compare`), else None: one run drawn against itself, under one label twice."""
    twice = sorted({str(paths[i]) for i, k in enumerate(keys) if keys.count(k) > 1})
    if not twice:
        return None
    return (f"{twice[0]} is given twice: pass each run once" if len(twice) == 1 else
            f"{' and '.join(twice)} are the same report: pass each run once")


def write_compare(paths: list[str], out: str | Path) -> "CompareResult":
    from store.format import atomic_write_bytes
    from store.io_errors import writing

    if len(paths) < 2:
        raise UserError("pipeline compare needs at least two reports or runs")
    out = Path(out)
    refuse_other_files(out)
    if twice := given_twice(paths, [find_group(p).resolve() for p in paths]):  # R and R/losses.zarr: one curve
        raise UserError(twice)
    runs = [read_curves(p, label) for p, label in zip(paths, labels_for(paths))]
    check_same_held_out(runs)
    emas = any(r.ema is not None for r in runs)  # a `weights` column (lora / ema) only then: older tables as before
    rows = [["run", "step", "checkpoint", "loss", "loss_inside", "loss_outside", "best", "on_disk"]
            + (["weights"] if emas else [])]
    yes_no = {True: "yes", False: "no", None: ""}
    for r in runs:
        rows.append([r.label, "base", "", r.base["all"], r.base["inside"], r.base["outside"], "", ""]
                    + ([""] if emas else []))
        for weights, c in (("lora", r), ("ema", r.ema)):
            for i, s in enumerate(c.steps if c is not None else []):
                rows.append([r.label, s, c.checkpoints[i], c.overall[i], c.inside[i], c.outside[i],
                             "best" if r.best == (weights, i) else "", yes_no[c.on_disk[i]]]
                            + ([weights] if emas else []))
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    vs_best = paired_to_best(runs)
    page = render(runs, vs_best)
    with writing("the comparison", out):
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out / "curves.csv", buf.getvalue().encode())
        atomic_write_bytes(out / "index.html", page.encode())
    return CompareResult(runs, out / "index.html", out / "curves.csv", vs_best)


def _series(r: RunCurves, region: str, values: str) -> list[Series]:
    """A run's raw curve, and its EMA curve beside it labelled "LABEL (EMA)"; the best ringed on its own curve."""
    best = r.best
    out = [Series(r.label, r.steps, getattr(r, values), r.base[region],
                  r.steps[best[1]] if best is not None and best[0] == "lora" and region == "all" else None)]
    if r.ema is not None:
        out.append(Series(f"{r.label} (EMA)", r.ema.steps, getattr(r.ema, values), None,
                          r.ema.steps[best[1]] if best is not None and best[0] == "ema" and region == "all" else None))
    return out


def _best_row(r: RunCurves, emas: bool, vs_best: dict | None) -> str:
    from stages.evaluate.paired import signed

    if (b := r.best_point) is None:
        return ""
    weights = f"<td>{'EMA' if b['weights'] == 'ema' else 'LoRA'}</td>" if emas else ""
    vs = f"{signed(vs_best)} (n = {vs_best['n']})" if vs_best else "best run"
    return (f"<tr><td>{html.escape(r.label)}</td><td>{b['step']}</td>{weights}<td>{b['loss']:.5g}</td>"
            f"<td>{html.escape(vs)}</td><td>{r.base['all']:.5g}</td><td><code>{html.escape(b['checkpoint'])}</code>"
            f"{' (not on disk)' if b['on_disk'] is False else ''}</td></tr>")


SURENESS_NOTE = ("vs best run: this run's best minus the best run's, paired over the val samples that picked "
                 "neither best (same noise and σ) ± its standard error; within about two standard errors this "
                 "held-out set does not tell the two runs apart")


def render(runs: list[RunCurves], vs_best: list[dict | None] | None = None) -> str:
    charts = [Chart("held-out loss per checkpoint (all val samples)",
                    [s for r in runs for s in _series(r, "all", "overall")])]
    for region in ("inside", "outside"):
        series = [s for r in runs for s in _series(r, region, region)]
        if any(v == v for s in series for v in s.values):  # NaN != NaN: no masked sample, no chart
            charts.append(Chart(f"{region} the edit mask", series))
    emas = any(r.ema is not None for r in runs)  # a weights column (LoRA / EMA) only then
    best_rows = "".join(_best_row(r, emas, v) for r, v in zip(runs, vs_best or [None] * len(runs)))
    held = runs[0].held_out
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Run comparison</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin: 8px 0 16px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; }}
th {{ background: #f3f3f3; }}
svg {{ margin: 0 16px 16px 0; border: 1px solid #eee; }}
</style></head><body>
<h1>Run comparison</h1>
<p>Same held-out set: {len(held['val samples'])} val samples x noise seeds {held['noise seeds']} x σ {held['σ grid']}
(store tables {html.escape(json.dumps(held['store tables']))}).</p>
<table><thead><tr><th>run</th><th>best step</th>{'<th>weights</th>' if emas else ''}<th>held-out loss</th><th>vs best run (paired ± s.e.)</th><th>base</th><th>checkpoint</th></tr></thead>
<tbody>{best_rows}</tbody></table>
<p>{html.escape(SURENESS_NOTE)}.</p>
{''.join(svg(c) for c in charts)}
</body></html>
"""


@dataclass
class CompareResult:
    runs: list[RunCurves]
    report: Path
    csv: Path
    # per run: its best minus the best run's, paired over the val samples (`paired_to_best`); None: the best run
    vs_best: list[dict | None] | None = None
    stage: str = "compare"
    up_to_date: bool = False

    def to_json(self) -> dict:
        from schemas.stage import absolute

        vs_best = self.vs_best or [None] * len(self.runs)
        return {"stage": self.stage, "report": absolute(self.report), "csv": absolute(self.csv),
                "runs": [self._run_json(r, v) for r, v in zip(self.runs, vs_best)]}

    @staticmethod
    def _run_json(r: RunCurves, vs_best: dict | None = None) -> dict:
        from schemas.stage import absolute

        b = r.best_point or {}
        out = {"label": r.label, "group": absolute(r.group), "best_step": b.get("step"),
               "best_checkpoint": b.get("checkpoint"), "best_loss": b.get("loss"), "vs_best_run": vs_best}
        if r.ema is not None:  # the report's `best_weights`; a run without EMA: as before
            out["best_weights"] = b.get("weights")
        return out

    def __str__(self) -> str:
        def one(r: RunCurves) -> str:
            if (b := r.best_point) is None:
                return f"{r.label}: no finite loss"
            weights = (" (EMA)" if b["weights"] == "ema" else " (LoRA)") if r.ema is not None else ""
            return f"{r.label}: best step {b['step']}{weights} ({b['loss']:.4f})"

        bests = "; ".join(one(r) for r in self.runs)
        return f"compared {len(self.runs)} runs ({bests}){self._sureness()}; page {self.report}, table {self.csv}"

    def _sureness(self) -> str:
        """'; vs the best run a: b +0.0123 ± 0.0040 (paired over 6 val samples, ± s.e.)', or '' (no pair)."""
        from stages.evaluate.paired import signed

        pairs = [(r, v) for r, v in zip(self.runs, self.vs_best or []) if v is not None]
        if not pairs:
            return ""
        n = ", ".join(sorted({str(v["n"]) for _, v in pairs}))
        return (f"; vs the best run {pairs[0][1]['run']}: " + ", ".join(f"{r.label} {signed(v)}" for r, v in pairs)
                + f" (paired over {n} val samples, ± s.e.)")
