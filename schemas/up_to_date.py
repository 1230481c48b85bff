"""The one up-to-date rule: an output is current when the inputs it recorded when it was made equal the inputs
derived now. Every stage decides reuse through it: a table version (`Store.find_version`: the schema's
`Lineage`), a run's final LoRA (train: the last checkpoint's resume record), a report (evaluate: `metrics.json`'s
inputs) and a checkpoint report (evaluate --all-checkpoints).

What goes into the inputs is the stage's business, derived from the declared lineage scheme
(`schemas.lineage`): a setting that enters no hash (device, batch size, workers) is in no record, so changing it
keeps every output current; a hashed one differs, so every path recomputes.

The code counts too where the settings cannot tell: train and evaluate record a revision of what they compute
(`stages/train/settings.py` `training_revision`, per config: the newest `TRAINING_REVISION` that changes its
weights; `stages/evaluate/loss_fingerprint.py` `EVALUATION_REVISION`; the
encode stages' is their feature revision, `schemas.lineage.code_version`), so a release that fixes their math
recomputes their outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping

if TYPE_CHECKING:
    from schemas.lineage import Lineage


# The revision of an output recorded before its stage recorded one: the code that made it computed what each
# stage's first revision names (read as 1, an upgrade recomputes nothing; a later bump recomputes it too).
UNRECORDED_REVISION = 1


def stale_inputs(recorded: Mapping[str, Any] | None, present: Mapping[str, Any]) -> list[str]:
    """Names of the inputs whose recorded value is not the present one, in the present's order, then those only
    recorded (a missing record: every input)."""
    if recorded is None:
        return list(present)
    return [k for k in [*present, *(k for k in recorded if k not in present)] if recorded.get(k) != present.get(k)]


def stale_named(recorded: Mapping[str, Any] | None, present: Mapping[str, Any], labels: Mapping[str, str]) -> list[str]:
    """'LABEL BEFORE -> NOW' for each of `stale_inputs` (`labels`: input name -> what the user reads; a dict value
    shown by its entries that differ): the one wording of why an output is not current - train's refused resume
    and kept run, a table's new version, a report recomputed."""
    recorded = recorded or {}

    def differing(a: Any, b: Any) -> tuple[Any, Any]:
        if isinstance(a, dict) and isinstance(b, dict):
            keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
            return {k: a[k] for k in keys if k in a}, {k: b[k] for k in keys if k in b}
        return a, b

    return [f"{labels.get(k, k)} {before} -> {now}"
            for k in stale_inputs(recorded, present) for before, now in [differing(recorded.get(k), present.get(k))]]


def changed_settings(before: Mapping[str, Any], now: Mapping[str, Any], prefix: str,
                     ignore: Collection[str] = (), missing: str = "(unset)") -> list[str]:
    """'PREFIX.KEY: BEFORE -> NOW' for each setting (nested sections flattened to dotted keys) whose value differs
    between two records of a config section; `ignore`: top-level keys left out (those a change of which keeps the
    output current); `missing`: what a key one record lacks is shown as (a hashed record leaves a setting added
    later out at its default: "(default)"). What `stale_named`'s settings fingerprint stands for, named."""
    old, new = _flat(dict(before), prefix, ignore), _flat(dict(now), prefix, ignore)
    return [f"{k}: {_shown(old[k]) if k in old else missing} -> {_shown(new[k]) if k in new else missing}"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def _flat(d: dict[str, Any], prefix: str, ignore: Collection[str] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if k in ignore:
            continue
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(_flat(v, key) if isinstance(v, dict) and v else {key: v})
    return out


def _shown(value: Any, most: int = 80) -> str:
    """A setting's value as a line shows it (repr; a long one, e.g. a prompt template, cut)."""
    text = repr(value)
    return text if len(text) <= most else text[:most - 1] + "…"


def lineage_differences(recorded: Lineage, present: Lineage, labels: Mapping[str, str]) -> list[str]:
    """`stale_named` over two table versions' lineages: their settings fingerprint and data (a config hash is
    `<settings>-<data>`: the upstream table's identity, a source's listing), model fingerprint and code revision.
    `labels`: what the stage calls "settings" and "data" (e.g. "encode_vae settings", "input")."""
    def inputs(lineage: Lineage) -> dict[str, str]:
        settings, _, data = lineage.config_hash.partition("-")
        return {"settings": settings, "data": data, "model_fingerprint": lineage.model_fingerprint,
                "code_version": lineage.code_version}

    return stale_named(inputs(recorded), inputs(present),
                       {"model_fingerprint": "model fingerprint", "code_version": "code revision", **labels})


def new_version_line(stage: str, table: str, version: int, differences: list[str]) -> str:
    """Why a stage writes a new version of `table` instead of reusing `version` (its newest complete one)."""
    return f"{stage}: table '{table}' v{version} is not this run's ({'; '.join(differences)}): writing a new version"


def is_current(recorded: Mapping[str, Any] | None, present: Mapping[str, Any]) -> bool:
    """The output that recorded `recorded` is what `present` would make now: reuse it."""
    return not stale_inputs(recorded, present)


def serves_on_damaged(on_damaged: str, left_out: Callable[[], object]) -> bool:
    """An output that left damaged inputs out (`left_out()`: its record of them, read under "stop" only) serves a
    run under on_damaged=skip only: under "stop" those inputs stop the run (or, repaired, are read), where the
    output would pass for one of every input. on_damaged is in no hash (a rerun or a resume may switch it): this is where it
    still counts, one rule for every stage's output (a table version, a run's LoRA, a report)."""
    return on_damaged == "skip" or not left_out()


# ---------------------------------------------------------------------------------------------- a training's record
# (train's resume and up-to-date checks, evaluate's "one training" of its checkpoints: one rule for both)


def compared_tables(recorded: dict[str, str], recorded_contents: dict[str, str] | None, now: dict[str, str],
                    contents: Callable[[], dict[str, str] | None] | None) -> tuple[Any, Any]:
    """The (recorded, present) values a resume or the up-to-date check compares as the run's tables: their
    content identities when the version ids differ and both sides have them for the same tables, else the
    version ids (a record written before contents were recorded compares as it did). `contents()` gives the
    present ones: computed only when the ids differ (a hash of the joined manifests' checksum columns)."""
    if recorded == now or not recorded_contents or contents is None:
        return recorded, now
    present = contents()
    if not present or set(present) != set(recorded_contents) or set(recorded) != set(now):
        return recorded, now
    return recorded_contents, present


def known_backend(record: Mapping[str, Any], other: Mapping[str, Any]) -> str | None:
    """The attention backend a checkpoint record (`record`, its inputs with its `extra` keys, as evaluate's
    `training_of` reads them) trained with, as compared with `other`'s: its own; for a record written before the
    backend was recorded, the one `other`'s run took such records for on its resume (`UNRECORDED_BACKEND`); else
    None, unknown (equal only to another unknown one)."""
    from schemas.record_formats import UNRECORDED_BACKEND

    backend = record.get("attention_backend")
    return backend if backend is not None else other.get(UNRECORDED_BACKEND)


def known_init_lora(recorded: str | None, now: str | None) -> str | None:
    """The record's init LoRA hash, read as `now` when it has none: a checkpoint written before the hash was
    recorded, with train.init_lora set (its config fingerprint, which holds the path, equals this start's, else
    that differs). Its bytes were never recorded; it is taken as made from the present file, as before (refused,
    every such run would be trained again)."""
    return recorded if recorded is not None else now
