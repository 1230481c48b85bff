"""`pipeline compare`: several runs' held-out loss curves and best points on one page, plus a CSV.

Each input is a report folder (holding `losses.zarr`, written by `evaluate --all-checkpoints` or `run all`) or a
run folder whose report was kept inside it (`RUN/evaluate-report/`). Runs are comparable only on the same
held-out set: the same store `text` / `vae` table versions, the same val sample keys, noise seeds and σ grid,
measured the same way (base model, and evaluate's dtype, LoRA scale, quantised base, attention backend);
anything else is refused with the difference named (numbers of different held-out sets are not one scale).
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

    @property
    def best(self) -> int | None:
        """The report's rule (stages/evaluate/checkpoints.py `_summary`): the lowest finite loss among the
        checkpoints still on disk; a pruned one keeps its point on the curve but is never named. A report looked
        at away from its run (copied, none of its checkpoints here) names its curve's minimum."""
        rows = [i for i, here in enumerate(self.on_disk) if here is not False] or list(range(len(self.steps)))
        best = pick_best([self.steps[i] for i in rows], [self.overall[i] for i in rows])
        return None if best is None else rows[best]


def find_group(path: str | Path) -> Path:
    p = Path(path)
    for candidate in (p / GROUP, p / KEPT_REPORT / GROUP, p if p.name.endswith(".zarr") else None):
        if candidate is not None and (candidate / "zarr.json").is_file():
            return candidate
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


def read_curves(path: str | Path, label: str) -> RunCurves:
    group = find_group(path)
    from tqdm.auto import tqdm

    ds = open_dataset(group, say=tqdm.write)  # in step order; an array of an earlier release lacking a chunk: a line
    settings = dict(ds.attrs.get("settings", {}))
    if isinstance(settings.get("evaluate"), dict):  # an unset backend recorded before it was hashed as resolved
        settings["evaluate"] = as_resolved(settings["evaluate"], group.parent, dict(ds.attrs.get("settings", {})))
        # seeds and σ are sets of rows (schemas/config.py `_A_SET_OF_ROWS`): recorded in another order, the same
        settings["evaluate"] = {k: sorted(v) if k in ("noise_seeds", "timesteps") and isinstance(v, list) else v
                                for k, v in settings["evaluate"].items()}
    loss = ds.loss.values.astype(np.float64)  # [step, sample, seed, sigma, region]
    base = ds.base_loss.values.astype(np.float64) if "base_loss" in ds else np.full(loss.shape[1:], np.nan)
    regions = [str(r) for r in ds.region.values]
    r = {name: regions.index(name) for name in ("all", "inside", "outside")}
    # the samples evaluate's numbers are over (stages/evaluate/checkpoints.py `_summary`); without a base, all
    kept = _kept(base[..., r["all"]]) if "base_loss" in ds else np.ones(loss.shape[1], dtype=bool)
    two = kept & (_kept(base[..., r["inside"]]) if "base_loss" in ds else np.isfinite(loss[..., r["inside"]]).any(
        axis=tuple(i for i in range(loss.ndim - 1) if i != 1)))
    checkpoints = [str(c) for c in ds.checkpoint.values]
    return RunCurves(
        label=label, group=group, steps=[int(s) for s in ds.step.values], checkpoints=checkpoints,
        # evaluate records each checkpoint's folder; validation while training a label ("training step N")
        on_disk=[Path(c).exists() if Path(c).is_absolute() else None for c in checkpoints],
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
            # set before: one held-out set, `checkpoints.samples_read`)
            "evaluate settings": settings.get("evaluate") and {k: v for k, v in settings["evaluate"].items()
                                                                if k not in ("on_damaged", "max_loss_samples")},
        },
        table_versions=_table_versions(settings, dict(ds.attrs)),
        measured=_measured(settings, dict(ds.attrs), group.parent),
    )


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
        autocast = " with bf16 autocast" if train.get("mixed_precision") == "bf16" else ""
        return {"precision": f"{train.get('dtype')}{autocast}", "quantize_base": train.get("quantize_base", "none"),
                "attention_backend": train.get("attention_backend") or _run_backend(folder), "lora_scale": 1.0}
    return None


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
            if what == "evaluate settings" and (value is None or theirs is None):
                continue  # validation while training records none (RUN/losses.zarr): comparable as before
            if what == "store tables" and theirs != value and first.table_versions is not None and \
                    first.table_versions == other.table_versions:
                continue  # one names the tables by content, the other by version ids: the same versions read
            if theirs != value:
                detail = ""
                if what == "val samples":
                    a, b = set(value), set(theirs)
                    detail = f" ({len(a - b)} only in the first, {len(b - a)} only in the other)"
                elif what in ("store tables", "base model"):
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
    rows = [["run", "step", "checkpoint", "loss", "loss_inside", "loss_outside", "best", "on_disk"]]
    yes_no = {True: "yes", False: "no", None: ""}
    for r in runs:
        rows.append([r.label, "base", "", r.base["all"], r.base["inside"], r.base["outside"], "", ""])
        for i, s in enumerate(r.steps):
            rows.append([r.label, s, r.checkpoints[i], r.overall[i], r.inside[i], r.outside[i],
                         "best" if i == r.best else "", yes_no[r.on_disk[i]]])
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    page = render(runs)
    with writing("the comparison", out):
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out / "curves.csv", buf.getvalue().encode())
        atomic_write_bytes(out / "index.html", page.encode())
    return CompareResult(runs, out / "index.html", out / "curves.csv")


def render(runs: list[RunCurves]) -> str:
    charts = [Chart("held-out loss per checkpoint (all val samples)",
                    [Series(r.label, r.steps, r.overall, r.base["all"], r.steps[r.best] if r.best is not None else None)
                     for r in runs])]
    for region in ("inside", "outside"):
        series = [Series(r.label, r.steps, getattr(r, region), r.base[region]) for r in runs]
        if any(v == v for s in series for v in s.values):  # NaN != NaN: no masked sample, no chart
            charts.append(Chart(f"{region} the edit mask", series))
    best_rows = "".join(
        f"<tr><td>{html.escape(r.label)}</td><td>{r.steps[r.best] if r.best is not None else '–'}</td>"
        f"<td>{r.overall[r.best]:.5g}</td><td>{r.base['all']:.5g}</td>"
        f"<td><code>{html.escape(r.checkpoints[r.best])}</code>{' (not on disk)' if r.on_disk[r.best] is False else ''}"
        "</td></tr>" if r.best is not None else ""
        for r in runs)
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
<table><thead><tr><th>run</th><th>best step</th><th>held-out loss</th><th>base</th><th>checkpoint</th></tr></thead>
<tbody>{best_rows}</tbody></table>
{''.join(svg(c) for c in charts)}
</body></html>
"""


@dataclass
class CompareResult:
    runs: list[RunCurves]
    report: Path
    csv: Path
    stage: str = "compare"
    up_to_date: bool = False

    def to_json(self) -> dict:
        from schemas.stage import absolute

        return {"stage": self.stage, "report": absolute(self.report), "csv": absolute(self.csv),
                "runs": [{"label": r.label, "group": absolute(r.group), "best_step": r.steps[r.best] if r.best is not None
                          else None, "best_checkpoint": r.checkpoints[r.best] if r.best is not None else None,
                          "best_loss": r.overall[r.best] if r.best is not None else None} for r in self.runs]}

    def __str__(self) -> str:
        bests = "; ".join(f"{r.label}: best step {r.steps[r.best]} ({r.overall[r.best]:.4f})" if r.best is not None
                          else f"{r.label}: no finite loss" for r in self.runs)
        return f"compared {len(self.runs)} runs ({bests}); page {self.report}, table {self.csv}"
