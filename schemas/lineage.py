"""Lineage: everything that determines a table version's features. Equal lineage = reusable version."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any

from schemas.errors import UserError


def code_version(feature_revision: str) -> str:
    """Package version + the stage's feature-format revision (bumped when the stored features change)."""
    try:
        pkg = metadata.version("qwen-edit-lora-pipeline")
    except metadata.PackageNotFoundError:
        pkg = "0+unknown"
    return f"{pkg}+{feature_revision}"


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
