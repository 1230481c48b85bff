"""What single-LoRA evaluate returns: the report's metrics and page, its summary record and line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from schemas.stage import few
from stages.evaluate.paired import signed


@dataclass
class EvaluateResult:
    metrics: dict  # what metrics.json holds
    report: Path  # index.html
    up_to_date: bool = False
    stage: str = "evaluate"
    seconds: float = 0.0
    damaged: dict[str, str] | None = None  # evaluate.on_damaged=skip: samples left out, key -> problem

    def to_json(self) -> dict:
        from schemas.stage import absolute, summary_record

        loss = self.metrics.get("loss", {}).get("overall", {})
        return summary_record(self.stage, seconds=self.seconds, up_to_date=self.up_to_date, report=absolute(self.report),
                              val_samples=loss.get("n"), loss_base=loss.get("base"), loss_lora=loss.get("lora"),
                              damaged_samples=sorted(self.damaged or {}))

    def __str__(self) -> str:
        overall = self.metrics["loss"]["overall"]
        diff = self.metrics["loss"].get("lora_minus_base")
        sure = f" ({signed(diff)}, paired ± s.e.)" if diff else ""
        # up to date: its numbers too (a rerun of `pipeline run evaluate` said only that)
        line = (f"report {self.report.parent} is up to date; " if self.up_to_date else "") + (
            f"held-out loss on {overall['n']} val samples: base {overall['base']:.4f} -> LoRA {overall['lora']:.4f}"
            f"{sure}; report: {self.report}")
        nonfinite = self.metrics["loss"].get("nonfinite_samples")
        if nonfinite:
            line += (f"\nleft out {len(nonfinite)} val sample(s) with a non-finite loss (evaluate.on_nonfinite=skip; "
                     f"listed in metrics.json loss.nonfinite_samples): {few(nonfinite)}")
        if self.damaged:
            line += (f"\nskipped {len(self.damaged)} damaged val sample(s) (evaluate.on_damaged=skip; listed in "
                     f"metrics.json run.damaged_samples): {few(self.damaged)}")
        return line
