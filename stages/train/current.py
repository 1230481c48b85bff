"""Whether OUT already holds the final LoRA of this very run (`pipeline run all`'s `skip_if_done`), by the one
up-to-date rule (`schemas/up_to_date.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from features.open import open_configured
from models.lora import WEIGHT_NAME
from schemas import up_to_date as current
from schemas.config import PipelineConfig, TrainConfig
from stages.train import damaged_log, shorter, state as train_state
from stages.train.settings import (config_fingerprint, has_masks, known_fingerprint, name_tables, training_revision,
                                   init_lora_sha256, planned_device, recorded_backend, resolve_precision,
                                   run_backend, weighed)
from stages.train.state import ResumeRecord
from store.join import JoinedTables


def up_to_date(cfg: PipelineConfig, store: str | Path, model: str, out: str | Path,
               train: TrainConfig | None = None, backend: str | None = None, check_bytes: bool = True) -> bool:
    """OUT/lora is the final LoRA of a run on the same tables, model, train config and init LoRA bytes, trained to
    max_steps under this code's training revision (`schemas.up_to_date`: the last checkpoint's record against
    `run_inputs`), its bytes and the checkpoint's those train sealed (`_intact`, `ResumeRecord.read`;
    `check_bytes` False: left to another rank, whose answer the ranks share). `train`: the train section as resolved already (`resolved_train`; several ranks:
    agreed); `backend`: the attention backend as resolved already (`run_backend`; several ranks: agreed)."""
    weights = Path(out) / "lora" / WEIGHT_NAME
    latest = train_state.latest_checkpoint(Path(out) / "checkpoints")
    if not weights.is_file() or latest is None:
        return False
    # a LoRA older than the last checkpoint is a previous run's (killed before its final save)
    if weights.stat().st_mtime < (latest / train_state.RESUME_JSON).stat().st_mtime:
        return False
    try:
        record = ResumeRecord.read(latest / train_state.RESUME_JSON, files=check_bytes)
    except train_state.CheckpointDamaged:  # no finished run to stand on: the start names it (or keeps it aside)
        return False
    return _same_run(record, cfg, store, model, out, train, backend, step=True) and \
        (not check_bytes or _intact(weights, Path(out)))


def _intact(weights: Path, out: Path) -> bool:
    """The final LoRA's bytes are those train sealed in its checksums.json. A flipped bit or a cut file is not
    the run's LoRA: said in one line, and the run is not up to date (up to date, `run all` passed the damage on
    to whoever loads it); what follows says itself (a resume writes the file again; a kept run is left as it
    is)."""
    from schemas.errors import UserError
    from store.checksum import check_recorded

    try:
        check_recorded(weights, levels=1)
    except UserError as e:
        tqdm.write(f"{e}; so the run in {out} is not up to date")
        return False
    return True


def resumable_step(cfg: PipelineConfig, store: str | Path, model: str, out: str | Path,
                   train: TrainConfig | None = None, backend: str | None = None) -> int | None:
    """The step a resume of OUT continues from (`up_to_date`'s comparison without the step: a run of these
    settings and inputs): its last checkpoint's when not past max_steps; past it, under a schedule that does not
    depend on max_steps, its newest checkpoint at or below max_steps (`shorter`: a start keeps the run and goes on
    from there). Else None. One process (`run all`'s take-back)."""
    latest = train_state.latest_checkpoint(Path(out) / "checkpoints")
    if latest is None:
        return None
    record = ResumeRecord.read(latest / train_state.RESUME_JSON)
    step = record.step
    if step > cfg.train.max_steps:
        point = None if shorter.depends_on_max_steps(cfg.train) else \
            shorter.start_point(Path(out) / "checkpoints", cfg.train.max_steps)
        if point is None:
            return None
        step = train_state.step_of(point)
    return step if _same_run(record, cfg, store, model, out, train, backend, step=False) else None


def _same_run(record: ResumeRecord, cfg: PipelineConfig, store: str | Path, model: str, out: str | Path,
              train: TrainConfig | None, backend: str | None, step: bool) -> bool:
    """The record's inputs are the present ones (`step`: its step max_steps too)."""
    train = train or resolved_train(cfg)
    if not damaged_current(Path(out), train, record.step) or not nonfinite_current(record, train):
        return False
    now, tables, masked = _inputs(cfg, store, model, train)
    if not step:
        now["step"] = record.step
    now["attention_backend"] = backend or run_backend(train, model, planned_device(train))
    recorded = {"step": record.step, **record.inputs()}
    # a record from before the backend was recorded: the one its run used, where known (`recorded_backend`)
    recorded["attention_backend"] = recorded_backend(record.attention_backend, record.config_fingerprint, train,
                                                     Path(out), now["attention_backend"])
    # the same samples under other version numbers (an `images` rerun that changed none) are the same run
    recorded["tables"], now["tables"] = train_state.compared_tables(record.tables, record.table_contents,
                                                                    now["tables"], tables.content_ids)
    # an earlier spelling (a backend hashed by name: the one resolved now)
    recorded["config_fingerprint"] = known_fingerprint(recorded["config_fingerprint"], train, now["attention_backend"],
                                                       masked)
    recorded["init_lora_sha256"] = train_state.known_init_lora(record.init_lora_sha256, now["init_lora_sha256"])
    return current.is_current(recorded, now)


def damaged_current(out: Path, train: TrainConfig, step: int | None = None) -> bool:
    """A run that left damaged samples out (RUN/damaged_samples.jsonl; at steps up to its checkpoint's `step`: a
    killed start's findings past it are no part of it) is current under on_damaged=skip only: under
    "stop" they stop training (or, repaired, are trained on), where the LoRA would pass for one of every sample.
    on_damaged is in no hash (a resume may switch it): this is where it still counts, as evaluate's
    `damaged_current` does for a report (`schemas.up_to_date.serves_on_damaged`)."""
    return current.serves_on_damaged(train.on_damaged, lambda: damaged_log.read(out, up_to=step))


def nonfinite_current(record: ResumeRecord, train: TrainConfig) -> bool:
    """A run that skipped optimizer steps for a non-finite loss or gradient is current under
    on_nonfinite=skip_step only: under "stop" that step stops training, where the LoRA would pass for one that
    applied every step (on_nonfinite is in no hash either)."""
    return train.on_nonfinite == "skip_step" or not train_state.nonfinite_skipped(record)


def run_inputs(cfg: PipelineConfig, store: str | Path, model: str) -> dict[str, Any]:
    """What a finished run of `cfg` records: its last step, config fingerprint, table versions, model, the
    init LoRA's bytes and the training revision."""
    return _inputs(cfg, store, model, resolved_train(cfg))[0]


def _inputs(cfg: PipelineConfig, store: str | Path, model: str,
            train: TrainConfig) -> tuple[dict[str, Any], JoinedTables, bool]:
    """`run_inputs`, the joined tables (closed) for their content identities, and whether the vae table holds a
    masked sample (`settings.has_masks`)."""
    from models.loading import model_files
    from schemas.model_files import fingerprint_of

    files = model_files(model)  # one walk: the tables' check and the record's fingerprint
    tables = open_configured(cfg.train, "train", store, model, files, "train",  # as training does
                             say_dropped=False)  # the trainer says it (a run that is not current trains)
    masked = has_masks(tables)
    name_tables(train, tables)
    tables.close()  # only its versions (or contents: from the manifests it holds) are compared
    return {
        "step": cfg.train.max_steps,
        # the run records its resolved precision (dtype auto -> float32 / bfloat16 for its device)
        "config_fingerprint": config_fingerprint(weighed(train, masked)),
        "tables": tables.versions(),
        "model_fingerprint": fingerprint_of(files),
        "init_lora_sha256": init_lora_sha256(cfg.train),
        "training_revision": training_revision(cfg.train),
    }, tables, masked


def resolved_train(cfg: PipelineConfig, world: int = 1) -> TrainConfig:
    """The train section as a run records it: its precision resolved (dtype auto -> float32 / bfloat16), with
    several ranks (`world`) by all of them together (a collective: every rank calls it)."""
    return resolve_precision(cfg.train, lambda: planned_device(cfg.train), world)  # resolved within the agreement
