"""`pipeline run all`: resize-bucket -> encode-text -> encode-vae -> train -> evaluate, each skipped when up to
date, every one resumable, so a killed `run all` rerun continues where it stopped.

The up-to-date checks are the stages' own: resize-bucket and the encode stages find a table version with the
same lineage and reuse it (a killed one resumes from its committed shards); train is up to date when RUN/lora
was written after the last checkpoint and that checkpoint was trained on the same tables, model and train
config up to `train.max_steps` (otherwise train resumes from its last checkpoint); evaluate is up to date when
REPORT/metrics.json records the same tables, model, LoRA bytes and evaluate config.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pipeline.config import PipelineConfig
from schemas.errors import UserError

@dataclass
class StageOutcome:
    stage: str
    skipped: bool
    summary: str
    seconds: float


@dataclass
class AllResult:
    outcomes: list[StageOutcome] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)  # train losses of this invocation (empty when skipped)
    metrics: dict = field(default_factory=dict)  # the evaluate report's metrics.json
    report: Path | None = None


@dataclass(frozen=True)
class Paths:
    source: str
    store: str
    model: str
    run: Path
    report: Path

    @property
    def lora(self) -> Path:
        return self.run / "lora"


def required_paths(cfg: PipelineConfig) -> Paths:
    missing = [k for k in ("source", "store", "model", "run", "report") if getattr(cfg.paths, k) is None]
    if missing:
        raise UserError(
            f"`pipeline run all` needs paths.{', paths.'.join(missing)} in the config file "
            "(see configs/demo.yaml for a complete example)"
        )
    p = cfg.paths
    return Paths(p.source, p.store, p.model, Path(p.run), Path(p.report))  # type: ignore[arg-type]


def train_up_to_date(cfg: PipelineConfig, paths: Paths) -> bool:
    """RUN/lora is the final LoRA of a run on the same tables, model and train config, trained to max_steps."""
    from models.loading import model_fingerprint
    from stages import train_state
    from stages.lora_merge import WEIGHT_NAME
    from stages.train import config_fingerprint, planned_device, resolve_precision
    from stages.train_data import open_train_tables

    weights = paths.lora / WEIGHT_NAME
    latest = train_state.latest_checkpoint(paths.run / "checkpoints")
    if not weights.is_file() or latest is None:
        return False
    record = train_state.ResumeRecord.read(latest / train_state.RESUME_JSON)
    tables = open_train_tables(paths.store, paths.model, split="train")
    return (
        record.step == cfg.train.max_steps
        # the run records its resolved precision (dtype auto -> float32 / bfloat16 for its device)
        and record.config_fingerprint == config_fingerprint(resolve_precision(cfg.train, planned_device(cfg.train)))
        and record.tables == tables.versions()
        and record.model_fingerprint == model_fingerprint(paths.model)
        # a LoRA older than the last checkpoint is a previous run's (killed before its final save)
        and weights.stat().st_mtime >= (latest / train_state.RESUME_JSON).stat().st_mtime
    )


# Each step runs one stage (or finds it up to date) and returns (skipped, one-line summary).
Step = Callable[[PipelineConfig, Paths, AllResult], tuple[bool, str]]


def resize_step(cfg: PipelineConfig, paths: Paths, result: AllResult) -> tuple[bool, str]:
    from stages import resize_bucket

    s = resize_bucket.run(cfg, paths.source, paths.store)
    return s.up_to_date, str(s)


def encode_text_step(cfg: PipelineConfig, paths: Paths, result: AllResult) -> tuple[bool, str]:
    from stages import encode_text

    s = encode_text.run(cfg, paths.store, paths.model)
    return s.up_to_date, str(s)


def encode_vae_step(cfg: PipelineConfig, paths: Paths, result: AllResult) -> tuple[bool, str]:
    from stages import encode_vae

    s = encode_vae.run(cfg, paths.store, paths.model)
    return s.up_to_date, str(s)


def train_step(cfg: PipelineConfig, paths: Paths, result: AllResult) -> tuple[bool, str]:
    from stages import train

    if train_up_to_date(cfg, paths):
        return True, f"LoRA {paths.lora} is up to date ({cfg.train.max_steps} steps on the current tables)"
    from stages.train_state import ResumeMismatch

    try:
        r = train.run(cfg, paths.store, paths.model, paths.run, resume=True)  # resume=True: continue if killed
    except ResumeMismatch as e:
        raise UserError(
            f"{e}\n`run all` trains into paths.run ({paths.run}): set paths.run to a new folder in the config to "
            "train with the new settings (or move the old run folder away)"
        ) from None
    result.train_losses = list(r.losses)
    how = f"resumed at step {r.start_step}" if r.start_step else "from scratch"
    loss = f", train loss {r.losses[0]:.4f} -> {r.losses[-1]:.4f}" if r.losses else ""
    return False, f"trained {how} to step {r.steps}{loss}; LoRA: {r.lora_dir}"


def evaluate_step(cfg: PipelineConfig, paths: Paths, result: AllResult) -> tuple[bool, str]:
    from stages import evaluate

    if evaluate.report_up_to_date(cfg.evaluate, paths.store, paths.model, paths.lora, paths.report):
        return True, f"report {paths.report} is up to date"
    evaluate.run(cfg.evaluate, paths.store, paths.model, paths.lora, paths.report)
    return False, f"report: {paths.report / 'index.html'}"


STEPS: list[tuple[str, Step]] = [
    ("resize-bucket", resize_step),
    ("encode-text", encode_text_step),
    ("encode-vae", encode_vae_step),
    ("train", train_step),
    ("evaluate", evaluate_step),
]


def run_all(cfg: PipelineConfig, log: Callable[[str], None] = print) -> AllResult:
    """Every stage in order; `log` gets a header per stage and its one-line summary."""
    paths = required_paths(cfg)
    result = AllResult(report=paths.report / "index.html")
    for name, step in STEPS:
        log(f"== {name}")
        t0 = time.perf_counter()
        skipped, summary = step(cfg, paths, result)
        outcome = StageOutcome(name, skipped, summary, time.perf_counter() - t0)
        result.outcomes.append(outcome)
        log(f"{summary}  [{'skipped, up to date' if skipped else f'{outcome.seconds:.1f} s'}]")
    result.metrics = json.loads((paths.report / "metrics.json").read_text())
    return result
