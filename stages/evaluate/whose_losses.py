"""Whose losses a loss group holds, for `evaluate --all-checkpoints`: which training wrote a checkpoint
(`training_of`, compared by `same_training`), and whether a group's rows are this run's (`this_runs`: no step of
other weights, of another run folder or of another training) or which group kept aside is (`this_runs_kept`)."""

from __future__ import annotations

import json
from pathlib import Path

from schemas.record_formats import EARLIER_FINGERPRINTS, UNRECORDED_BACKEND
from store.loss_array import Axes, LossGroup, kept_groups


def this_runs(group: LossGroup, checkpoints: list[tuple[int, Path]], shas: dict[int, str]) -> bool:
    """Are the losses in `group` this run's? Not when a step is recorded with other weights (another run trained
    into this folder), or of another run folder still on disk (this --out held another run's report), or of
    another training whose folder is gone (RUN trained afresh, its old checkpoints moved or deleted)."""
    return not (other_weights(group.steps(), shas) or _other_runs(group, checkpoints)
                or _other_trainings(group, checkpoints))


def this_runs_kept(out: Path, fingerprint: str, checkpoints: list[tuple[int, Path]], shas: dict[int, str],
                   axes: Axes | None = None, spelled=None) -> LossGroup | None:
    """The group kept aside in OUT under these settings (and `axes`' samples) that is this run's (`this_runs`)
    and holds the most of its checkpoints with the same bytes; None when none holds one. Run A, run B, then A
    again into one report folder: B set A's losses aside, and A's third run evaluated every checkpoint again
    beside them (a kept group was taken back only for other settings); now they are taken back."""
    best, most = None, 0
    for kept in kept_groups(out, fingerprint, axes, spelled):
        steps = kept.steps()
        held = sum(1 for step, sha in shas.items() if steps.get(step) == sha)
        if held > most and this_runs(kept, checkpoints, shas):
            best, most = kept, held
    return best


def other_weights(recorded: dict[int, str], shas: dict[int, str]) -> list[int]:
    """The steps recorded (step -> LoRA sha256) with other bytes than the checkpoint's now (another run trained
    into RUN): `_plan` sets the array aside, and `redone` says so."""
    return sorted(step for step, sha in shas.items() if recorded.get(step, sha) != sha)


def _other_runs(losses: LossGroup, checkpoints: list[tuple[int, Path]]) -> bool:
    """Does the array hold a checkpoint of another run folder that is still on disk? (One no longer on disk was
    pruned by this run, or the run folder moved: its numbers stay.)"""
    def run_of(path) -> Path:  # RUN/checkpoints/step-N/lora -> RUN
        parents = Path(path).resolve().parents
        return parents[2] if len(parents) > 2 else parents[-1]

    steps_now = {step for step, _ in checkpoints}
    runs_now = {run_of(path) for _, path in checkpoints}
    return any(step not in steps_now and Path(p).is_dir() and run_of(p) not in runs_now
               for step, p in losses.checkpoints().items())


def _other_trainings(losses: LossGroup, checkpoints: list[tuple[int, Path]]) -> bool:
    """Was a recorded step trained by another training than every checkpoint on disk now? A step no longer on disk
    is a checkpoint this run pruned only when the same training wrote it: `pipeline run train --new-run` (or RUN
    deleted and trained again) with other settings keeps no checkpoint of the old run in RUN, and its steps
    passed for pruned ones (the new run's curve went on with the old run's numbers). Steps recorded before the
    training was (older arrays) cannot tell: kept."""
    recorded = losses.trainings()
    if not recorded:
        return False
    now = [t for t in (training_of(path) for _, path in checkpoints) if t is not None]
    return any(not any(same_training(training, t) for t in now) for training in recorded.values())


# What a checkpoint's weights were trained from, in its step folder's resume.json (stages/train/state.py): the
# checkpoints of one training share these whatever their step, process count or max_steps (schemas.up_to_date)
_TRAINING_INPUTS = ("config_fingerprint", "model_fingerprint", "init_lora_sha256", "training_revision", "tables",
                    "table_contents", "attention_backend")


def training_of(checkpoint: Path) -> dict | None:
    """What trained the checkpoint (RUN/checkpoints/step-N/lora): its inputs as its resume.json records them
    (compared by `same_training`); None when there is no such record to read."""
    from schemas.record_formats import RESUME_JSON
    from store.checksum import SealError, is_sealed, unseal

    try:
        data = (Path(checkpoint).parent / RESUME_JSON).read_bytes()
        record = unseal(data) if is_sealed(data) else json.loads(data)
    except (OSError, ValueError, SealError):
        return None
    if not isinstance(record, dict) or not record.get("config_fingerprint"):
        return None
    extra = record.get("extra") if isinstance(record.get("extra"), dict) else {}
    earlier, unrecorded = extra.get(EARLIER_FINGERPRINTS), extra.get(UNRECORDED_BACKEND)
    return {**{k: record.get(k) for k in _TRAINING_INPUTS},
            **({EARLIER_FINGERPRINTS: list(earlier)} if isinstance(earlier, list) else {}),
            **({UNRECORDED_BACKEND: unrecorded} if isinstance(unrecorded, str) else {})}


def same_training(a: dict, b: dict) -> bool:
    """Whether two checkpoints' `training_of` are one training, as a resume from one to the other is (train's
    `ResumeRecord.check_matches`): the tables by content where both records hold it (`compared_tables`), an init
    LoRA's bytes where both recorded them (`known_init_lora`), the attention backend as `known_backend` reads a
    record that lacks it. A run begun before a record held those fields and resumed under a release that records
    them writes both kinds; compared as one hash, its pruned early steps passed for another training's and every
    earlier point went aside."""
    from schemas.up_to_date import compared_tables, known_backend, known_init_lora

    if any(a.get(k) != b.get(k) for k in ("model_fingerprint", "training_revision")):
        return False
    # one fingerprint, or one the other's run recorded under an earlier spelling of its settings and resumed
    fa, fb = a.get("config_fingerprint"), b.get("config_fingerprint")
    if fa != fb and fa not in (b.get(EARLIER_FINGERPRINTS) or ()) and fb not in (a.get(EARLIER_FINGERPRINTS) or ()):
        return False
    init = a.get("init_lora_sha256")
    if known_init_lora(init, b.get("init_lora_sha256")) != known_init_lora(b.get("init_lora_sha256"), init):
        return False
    # the backend trained with (the fingerprint hashes no backend name; an unrecorded one: `UNRECORDED_BACKEND`)
    if known_backend(a, b) != known_backend(b, a):
        return False
    contents = b.get("table_contents")
    tables = compared_tables(a.get("tables") or {}, a.get("table_contents"), b.get("tables") or {},
                             (lambda: contents) if contents else None)
    return tables[0] == tables[1]
