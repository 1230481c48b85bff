"""Lineage: everything that determines a table version's features (equal lineage = reusable version), and the
one declared scheme every settings hash is derived from (`Role`, `hashed_settings`)."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal

from pydantic import BaseModel

from schemas.errors import UserError


# The package version every lineage so far has recorded: fixed, not read from the installed package, so that a
# release recomputes nothing by itself (it re-rendered and re-encoded every table of every store); a change to
# stored features bumps that stage's feature revision instead (schemas/fixes.py: which samples each recomputes).
LINEAGE_PACKAGE_VERSION = "0.1.0"


def code_version(feature_revision: str) -> str:
    """The stage's feature-format revision (bumped when the stored features change), in the recorded form."""
    return f"{LINEAGE_PACKAGE_VERSION}+{feature_revision}"


@dataclass(frozen=True)
class Lineage:
    stage: str
    config_hash: str
    model_fingerprint: str = ""
    upstream: dict[str, int] = field(default_factory=dict)  # table -> version it was built from
    code_version: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["upstream"] = dict(sorted(self.upstream.items()))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Lineage":
        try:
            return cls(
                stage=str(d["stage"]),
                config_hash=str(d["config_hash"]),
                model_fingerprint=str(d.get("model_fingerprint", "")),
                upstream={str(k): int(v) for k, v in (d.get("upstream") or {}).items()},
                code_version=str(d.get("code_version", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"lineage record is malformed ({e!r}): {d!r}") from e


# ---------------------------------------------------------------- the declared lineage scheme
#
# Every field of every config section (schemas/config.py) carries one `Role` as an `Annotated` marker; the
# functions below derive every settings hash from those declarations (table versions, per-sample feature
# lineage, the train run fingerprint, the evaluate report's inputs). A marker adds nothing to the JSON schema.

RoleKind = Literal["features", "identity", "throughput"]


@dataclass(frozen=True)
class Role:
    """What a config setting changes, and so which hashes it enters.

    features:   the values computed (a sample's stored features, a run's trained weights, an evaluation's
                numbers): in every hash of its section.
    identity:   what an output is besides its per-sample values (which samples a table holds, how they are
                labelled): in the version / run fingerprint, not in the per-sample feature lineage (samples
                are carried forward across a change).
    throughput: how fast, where (device), in what file layout, how often it logs / checkpoints / validates,
                what happens on a failure: in no hash (changing it re-runs nothing).
    """

    kind: RoleKind
    # Added after outputs existed: hashed only when set to something other than its default, so the outputs
    # made before it existed stay current (a default of None / "off" changes nothing).
    hashed_unless_default: bool = False
    # features only while this holds for the section (e.g. max_steps under a decaying LR schedule)
    features_if: Callable[[Any], bool] | None = None
    # the value as it enters a hash, where part of it is recorded elsewhere (e.g. a file's path, whose bytes a
    # record of their own compares): a change to that part alone keeps outputs current
    hashed_as: Callable[[Any], Any] | None = None
    # read only while this holds for the section (e.g. evaluate's negative prompt, only with extra prompts):
    # otherwise it enters a hash as its default, so a change while unread recomputes nothing and outputs made
    # with the default stay current
    read_if: Callable[[Any], bool] | None = None
    # a bool whose True only stores more (extra columns; what False stores stays the same): an output made with it
    # True serves a run that sets it False (`serving_variants`), while False -> True recomputes
    adds_only: bool = False
    # throughput that acts only while training (what a run writes beside the LoRA: the validation curve, sample
    # grids, checkpoints, tracker logs, profiles): a rerun skipped as up to date trains nothing and so produces
    # nothing of it, which it says (stages/train/resume.py `unapplied_settings`) rather than pass over in silence
    while_training: bool = False

    def enters(self, scope: str, section: Any) -> bool:
        if self.features_if is not None:
            return self.features_if(section)
        return self.kind == "features" or (self.kind == "identity" and scope == "output")


FEATURES = Role("features")
IDENTITY = Role("identity")
THROUGHPUT = Role("throughput")
WHILE_TRAINING = Role("throughput", while_training=True)


def added_later(kind: RoleKind = "features") -> Role:
    return Role(kind, hashed_unless_default=True)


def adds_columns() -> Role:
    """A bool setting added later whose True only adds columns to the output (see `Role.adds_only`)."""
    return Role("features", hashed_unless_default=True, adds_only=True)


def role_of(model: type[BaseModel], name: str) -> Role | None:
    """The field's declared role (None = undeclared: `hashed_settings` refuses it)."""
    return next((m for m in model.model_fields[name].metadata if isinstance(m, Role)), None)


def while_training_names(model: type[BaseModel]) -> set[str]:
    """The model's top-level settings declared `WHILE_TRAINING`."""
    return {name for name in model.model_fields if getattr(role_of(model, name), "while_training", False)}


Scope = Literal["sample", "output"]


def hashed_settings(section: BaseModel, scope: Scope = "output", as_set: bool = False) -> dict[str, Any]:
    """The section's settings (JSON values) that enter a hash of `scope`: "sample" = per-sample feature
    lineage (features), "output" = a table version's or a run's fingerprint (features + identity). `as_set`:
    every value as set, `hashed_as` and `read_if` ignored: the spelling of records made before a field declared
    them (a stage that accepts those records compares it too)."""
    dumped = section.model_dump(mode="json")
    out: dict[str, Any] = {}
    for name, info in type(section).model_fields.items():
        role = role_of(type(section), name)
        if role is None:
            raise TypeError(f"{type(section).__name__}.{name} declares no lineage Role (schemas/lineage.py)")
        if not role.enters(scope, section):
            continue
        value = getattr(section, name)
        # added later: left out at its default, and (not as set) where it is hashed as its default
        if role.hashed_unless_default and (value == info.default or not as_set and role.hashed_as is not None
                                           and role.hashed_as(value) == info.default):
            continue
        if as_set:
            out[name] = hashed_settings(value, scope, as_set) if isinstance(value, BaseModel) else dumped[name]
        elif role.read_if is not None and not role.read_if(section):
            out[name] = section.model_copy(update={name: info.default}).model_dump(mode="json", include={name})[name]
        else:
            out[name] = hashed_settings(value, scope) if isinstance(value, BaseModel) else \
                role.hashed_as(value) if role.hashed_as is not None else dumped[name]
    return out


def unread_settings(section: BaseModel, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The paths (nested names) of the section's settings it does not read (their Role's `read_if` false: e.g. the
    σ parameters `sigma.sampling` does not read), which enter a hash as their defaults (`hashed_settings`)."""
    unread: set[tuple[str, ...]] = set()
    for name in type(section).model_fields:
        role, value = role_of(type(section), name), getattr(section, name)
        if role is not None and role.read_if is not None and not role.read_if(section):
            unread.add((*prefix, name))
        elif isinstance(value, BaseModel):
            unread |= unread_settings(value, (*prefix, name))
    return unread


def serving_variants(section: BaseModel) -> list[BaseModel]:
    """The settings, besides `section` itself, whose outputs serve a run of it: each combination of its `adds_only`
    settings that are off here turned on (such an output holds everything this run's would, plus columns it does
    not read). Top-level fields of the section only; empty when it has no such setting off."""
    off = []
    for name, info in type(section).model_fields.items():
        role = role_of(type(section), name)
        if role is None or not role.adds_only:
            continue
        if info.annotation is not bool or info.default is not False:
            raise TypeError(f"{type(section).__name__}.{name}: an adds-only setting must be a bool defaulting to False")
        if getattr(section, name) is False:
            off.append(name)
    return [section.model_copy(update=dict.fromkeys(names, True))
            for n in range(1, len(off) + 1) for names in itertools.combinations(off, n)]


def unhashed_names(section: BaseModel, scope: Scope = "output") -> set[str]:
    """Top-level settings of the section that enter no hash of `scope` (a change to them keeps outputs current)."""
    def unhashed(name: str, info: Any) -> bool:
        role = role_of(type(section), name) or THROUGHPUT
        return not role.enters(scope, section) or (role.hashed_unless_default and getattr(section, name) == info.default)

    return {name for name, info in type(section).model_fields.items() if unhashed(name, info)}


def settings_digest(settings: Any, default: Callable[[Any], Any] | None = None) -> str:
    """The one settings hash: sha256 (64 hex chars) over the settings' sorted-key JSON. Full length keys evaluate's
    loss groups and base images and train's validation curve; `default` spells a value JSON has none for (`str`: a
    path), None refuses one."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=default).encode()).hexdigest()


def settings_hash(settings: Any) -> str:
    """`settings_digest` at the 16 hex chars every stored lineage key holds (another length would make every
    store's tables out of date)."""
    return settings_digest(settings)[:16]


def section_fingerprint(section: BaseModel, scope: Scope = "output") -> str:
    """Fingerprint of a section's hashed settings (resize, train, evaluate; the encoders add their extras)."""
    return settings_hash(hashed_settings(section, scope))


def feature_lineage(stage: str, settings: Any, components: str = "", code_version: str = "",
                    upstream: str = "") -> str:
    """Per-sample feature lineage (store/reuse.py carries samples with an equal one forward): stage, feature
    settings, component fingerprint, code revision and the upstream table's feature lineage."""
    return settings_hash({"stage": stage, "settings": settings, "components": components, "code": code_version,
                          "upstream": upstream})
