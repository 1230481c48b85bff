"""What `--resume` tells the user before any model is loaded: that there is nothing to resume, or which
settings differ from the ones the run folder was trained with (its `train_config.yaml`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from schemas import up_to_date
from schemas.config import LoraConfig, TrainConfig
from schemas.lineage import role_of, unread_settings, while_training_names
from stages.train import previous, state as train_state

CONFIG_FILE = "train_config.yaml"  # the effective config of the run's latest start, written by stages.train


def nothing_to_resume(run_dir: Path, new_run: bool = False) -> str | None:
    """Why `--resume` into `run_dir` cannot continue anything, or None when it can (a checkpoint, or a run
    killed before its first checkpoint, which then starts again at step 0; with `new_run`, a run kept in
    RUN.previous, which the start takes back where these settings continue it: `recipe.take_back_kept`, e.g. a
    start to a lower max_steps killed after the keep, before its checkpoints were in RUN)."""
    checkpoints = run_dir / "checkpoints"
    if train_state.latest_checkpoint(checkpoints) is not None or (run_dir / CONFIG_FILE).is_file() or \
            train_state.unrecorded_checkpoints(checkpoints):  # a damaged one: the resume names it
        return None
    if new_run and previous.kept_runs(run_dir):  # --out is no typo: a run was kept from it
        return None
    what = "does not exist" if not run_dir.exists() else (
        "is empty" if run_dir.is_dir() and not any(run_dir.iterdir()) else f"holds no checkpoints/ and no {CONFIG_FILE}")
    return (f"--resume: nothing to resume, {run_dir} {what}. Check --out (paths.run), "
            "or leave out --resume to start a new run there")


def recorded_train(run_dir: Path) -> dict[str, Any] | None:
    """The `train` section the run folder's train_config.yaml records ({} for a file without one), or None when
    the file is missing or unreadable: not UTF-8 (dump_config writes UTF-8), not YAML, not a mapping."""
    try:
        before = yaml.safe_load((run_dir / CONFIG_FILE).read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    train = before.get("train") or {} if isinstance(before, dict) else None
    return train if isinstance(train, dict) else None


SHOWN_CHANGES = 5  # the changed settings a refusal lists (a few lines; the rest counted)


def changed_settings(run_dir: Path, now: dict[str, Any], ignore: set[str]) -> list[str]:
    """'train.learning_rate: 0.002 -> 0.001' for each `train.*` key that differs between
    the run folder's train_config.yaml and `now` (a PipelineConfig dump); `ignore` holds train keys a resume may
    change; past `SHOWN_CHANGES`, one line counts the rest. Empty when the file is missing or unreadable (the
    caller still has the fingerprints)."""
    train = recorded_train(run_dir)
    if train is None:
        return []
    recorded, present = _unread_dropped(_as_hashed(train), _as_hashed(now.get("train") or {}))
    changed = up_to_date.changed_settings(recorded, present, "train", ignore)
    if len(changed) <= SHOWN_CHANGES:
        return changed
    return [*changed[:SHOWN_CHANGES - 1], f"... and {len(changed) - SHOWN_CHANGES + 1} more train.* setting(s)"]


def _as_hashed(train: dict[str, Any]) -> dict[str, Any]:
    """`train` with lora.target_modules in the one order they are hashed in (schemas/config.py): names reordered
    are the same run, not a changed setting to set back."""
    lora = train.get("lora")
    if not isinstance(lora, dict) or not isinstance(lora.get("target_modules"), list):
        return train
    hashed = role_of(LoraConfig, "target_modules").hashed_as(lora["target_modules"])
    return {**train, "lora": {**lora, "target_modules": hashed}}


def _unread_dropped(before: dict[str, Any], now: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both records without the settings neither run reads (`unread_settings`: a σ parameter its sigma.sampling
    does not read, adam_betas / adam_eps under Adafactor): they enter the fingerprint as their defaults, so an
    edit to one is no reason the resume was refused, and listing it sent the user to set back what changes
    nothing. One read by either run stays (setting the other back makes it read). A record that does not
    validate (another version's file) is compared as written."""
    from pydantic import ValidationError

    try:
        unread = unread_settings(TrainConfig.model_validate(before)) & unread_settings(TrainConfig.model_validate(now))
    except ValidationError:
        return before, now
    return _without(before, unread), _without(now, unread)


def _without(values: dict[str, Any], paths: set[tuple[str, ...]]) -> dict[str, Any]:
    out = dict(values)
    for path in paths:
        inner = out
        for name in path[:-1]:
            if not isinstance(inner.get(name), dict):
                break
            inner[name] = inner = dict(inner[name])
        else:
            inner.pop(path[-1], None)
    return out


def unapplied_settings(run_dir: Path, now: dict[str, Any]) -> list[str]:
    """'train.validate_every: None -> 10' for each setting acting only while training (declared `WHILE_TRAINING`
    in schemas/config.py) that differs between the finished run's train_config.yaml and `now` (a PipelineConfig
    dump): what an up-to-date skip leaves undone, to be said, not passed over in silence. Empty when the file is
    missing or unreadable."""
    train = recorded_train(run_dir)
    if train is None:
        return []
    while_training = while_training_names(TrainConfig)
    recorded = {k: v for k, v in train.items() if k in while_training}
    # only those the file records: one written before a setting existed says nothing of it (no "(unset) -> 0")
    present = {k: v for k, v in (now.get("train") or {}).items() if k in recorded}
    return up_to_date.changed_settings(recorded, present, "train")
