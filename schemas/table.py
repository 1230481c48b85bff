"""Table schemas: schema versions, field specs and the `schema.json` record of one table version."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from schemas.errors import UserError
from schemas.lineage import Lineage

# v1: pixel height/width (+ control_height/control_width) columns, no img_shapes.
# v2: `img_shapes` column per sample (target first then each control, in transformer patch units).
SCHEMA_V1 = 1
SCHEMA_V2 = 2
CURRENT_SCHEMA_VERSION = SCHEMA_V2
KNOWN_SCHEMA_VERSIONS = (SCHEMA_V1, SCHEMA_V2)

# the vae table's column of each sample's latents' sha256 without its mask weights (encode-vae writes it; train
# names the table by it where the mask weighs nothing)
VAE_LATENTS_COLUMN = "latents_sha256"
TENSOR_DTYPES = ("bfloat16", "float16", "float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
FieldKind = Literal["tensor", "file", "column"]


@dataclass(frozen=True)
class FieldSpec:
    """One field of a sample. `name` may contain `{i}` for numbered fields (`control_{i}` = control_0, ...)."""

    name: str
    dtype: str  # tensors: a TENSOR_DTYPES name; files: a format ("png", "bytes"); columns: "string", "int64", "json"...
    rank: int = 0  # tensor rank; 0 for files and scalar columns
    kind: FieldKind = "tensor"
    optional: bool = False

    def matches(self, name: str) -> bool:
        if "{i}" not in self.name:
            return name == self.name
        pattern = re.escape(self.name).replace(re.escape("{i}"), r"\d+")
        return re.fullmatch(pattern, name) is not None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "rank": self.rank, "kind": self.kind, "optional": self.optional}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FieldSpec":
        return cls(
            name=d["name"], dtype=d["dtype"], rank=int(d.get("rank", 0)),
            kind=d.get("kind", "tensor"), optional=bool(d.get("optional", False)),
        )


@dataclass(frozen=True)
class TableSchema:
    """What `schema.json` holds for one table version. `attrs` carries table-wide facts (e.g. latents_mean/std)."""

    name: str
    fields: tuple[FieldSpec, ...]
    lineage: Lineage
    schema_version: int = CURRENT_SCHEMA_VERSION
    attrs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", tuple(self.fields))
        problems = self.problems()
        if problems:
            raise UserError(f"invalid schema for table '{self.name}': " + "; ".join(problems))

    def problems(self) -> list[str]:
        out: list[str] = []
        if self.schema_version not in KNOWN_SCHEMA_VERSIONS:
            out.append(f"schema_version {self.schema_version} unknown (expected one of {KNOWN_SCHEMA_VERSIONS})")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            out.append(f"table name {self.name!r} must be lowercase letters, digits, underscores")
        seen: set[str] = set()
        for f in self.fields:
            if f.name in seen:
                out.append(f"field {f.name!r} declared twice")
            seen.add(f.name)
            if f.kind not in ("tensor", "file", "column"):
                out.append(f"field {f.name!r}: kind {f.kind!r} unknown")
            if f.kind == "tensor" and f.dtype not in TENSOR_DTYPES:
                out.append(f"field {f.name!r}: tensor dtype {f.dtype!r} unknown")
            if "." in f.name and f.kind == "tensor":
                out.append(f"field {f.name!r}: tensor names cannot contain dots")
        return out

    def spec_for(self, kind: FieldKind, name: str) -> FieldSpec | None:
        return next((f for f in self.fields if f.kind == kind and f.matches(name)), None)

    def required(self, kind: FieldKind) -> list[str]:
        return [f.name for f in self.fields if f.kind == kind and not f.optional and "{i}" not in f.name]

    def to_dict(self) -> dict[str, Any]:
        return {
            "table": self.name,
            "schema_version": self.schema_version,
            "fields": [f.to_dict() for f in self.fields],
            "lineage": self.lineage.to_dict(),
            "attrs": self.attrs,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TableSchema":
        try:
            return cls(
                name=d["table"],
                fields=tuple(FieldSpec.from_dict(f) for f in d.get("fields", [])),
                lineage=Lineage.from_dict(d["lineage"]),
                schema_version=int(d["schema_version"]),
                attrs=dict(d.get("attrs") or {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"schema record is malformed: missing or bad {e}") from e
