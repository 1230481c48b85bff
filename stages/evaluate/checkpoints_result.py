"""What `evaluate --all-checkpoints` returns (`CheckpointsResult`): its metrics and report, the `--json` record
and the summary line (the best checkpoint, how sure, the checkpoints deleted or written meanwhile)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from models.lora_files import KEEPS_NEWEST
from schemas.units import count_text
from stages.evaluate.best_checkpoint import near_best_steps
from stages.evaluate.ema_curve import label as ema_label
from stages.evaluate.paired import NOISE_SE, signed, within_text
from stages.evaluate.selection import described
from store.loss_array import GROUP


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
                              best_vs_base=self.best.get("vs_base"), best_verdict=self.best.get("verdict"),
                              selection=_selection_counts(c.get("selection")), runner_up=self.best.get("runner_up"),
                              within_noise_of_best=self.best.get("within_noise"),
                              last_step=c["last"]["step"], damaged_samples=sorted(self.metrics["run"]["damaged_samples"]),
                              checkpoints_pruned=self.pruned, checkpoints_newer=self.newer)

    def __str__(self) -> str:
        b, c = self.best, self.metrics["checkpoints"]
        if self.up_to_date:
            head = f"report {self.report.parent} is up to date ({count_text(len(c['steps']), 'checkpoint')})"
        else:
            head = (f"evaluated {self.evaluated} of {count_text(len(c['steps']), 'checkpoint')} "
                    f"({len(c['steps']) - self.evaluated} already in {c['losses']}"
                    + (f"; {len(self.pruned)} deleted meanwhile, skipped: {KEEPS_NEWEST}" if self.pruned else "")
                    + ")")
        sure = ""
        if b.get("vs_base"):  # paired over val samples (reports written before these numbers have none)
            confirmed = described(c.get("selection"), b["vs_base"])  # which samples; none before it was recorded
            sure = f"; vs base {signed(b['vs_base'])}" + (f" {confirmed}" if confirmed else "")
            if b.get("runner_up"):
                sure += (f", next best step {b['runner_up']['step']}{ema_label(b['runner_up'], 'ema' in c)} "
                         f"{signed(b['runner_up'])}")
            sure += _near_best(b, "ema" in c) + (" (paired ± s.e.)" if confirmed else
                                                  f" (paired over {b['vs_base']['n']} val samples, ± s.e.)")
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
    within = within_text(best["vs_base"]["n"]) if best.get("vs_base") else f"within {NOISE_SE:g} s.e."
    return (f", not told apart from it ({within}): " + ", ".join(near[:most])
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


def _selection_counts(selection: dict | None) -> dict | None:
    """--json's `selection`: how the best was picked and confirmed, with counts where metrics.json lists the
    keys (None: a report written before it recorded them)."""
    if not selection:
        return None
    return {"how": selection.get("how"), "selected_on": len(selection.get("selected_on") or []),
            "confirmed_on": len(selection.get("confirmed_on") or []), "optimistic": selection.get("optimistic")}
