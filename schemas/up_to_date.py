"""The one up-to-date rule: an output is current when the inputs it recorded when it was made equal the inputs
derived now. Every stage decides reuse through it: a table version (`Store.find_version`: the schema's
`Lineage`), a run's final LoRA (train: the last checkpoint's resume record), a report (evaluate: `metrics.json`'s
inputs) and a checkpoint report (evaluate --all-checkpoints).

What goes into the inputs is the stage's business, derived from the declared lineage scheme
(`schemas.lineage`): a setting that enters no hash (device, batch size, workers) is in no record, so changing it
keeps every output current; a hashed one differs, so every path recomputes.

The code counts too where the settings cannot tell: train and evaluate record a revision of what they compute
(`stages/train/settings.py` `training_revision`, per config: the newest `TRAINING_REVISION` that changes its
weights; `stages/evaluate/checkpoints.py` `EVALUATION_REVISION`; the
encode stages' is their feature revision, `schemas.lineage.code_version`), so a release that fixes their math
recomputes their outputs.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping


# The revision of an output recorded before its stage recorded one: the code that made it computed what each
# stage's first revision names (read as 1, an upgrade recomputes nothing; a later bump recomputes it too).
UNRECORDED_REVISION = 1


def stale_inputs(recorded: Mapping[str, Any] | None, present: Mapping[str, Any]) -> list[str]:
    """Names of the inputs whose recorded value is not the present one, in the present's order, then those only
    recorded (a missing record: every input)."""
    if recorded is None:
        return list(present)
    return [k for k in [*present, *(k for k in recorded if k not in present)] if recorded.get(k) != present.get(k)]


def is_current(recorded: Mapping[str, Any] | None, present: Mapping[str, Any]) -> bool:
    """The output that recorded `recorded` is what `present` would make now: reuse it."""
    return not stale_inputs(recorded, present)


def serves_on_damaged(on_damaged: str, left_out: Callable[[], object]) -> bool:
    """An output that left damaged inputs out (`left_out()`: its record of them, read under "stop" only) serves a
    run under on_damaged=skip only: under "stop" those inputs stop the run (or, repaired, are read), where the
    output would pass for one of every input. on_damaged is in no hash (a rerun or a resume may switch it): this is where it
    still counts, one rule for every stage's output (a table version, a run's LoRA, a report)."""
    return on_damaged == "skip" or not left_out()
