"""The `images` table resize-bucket writes: its stage and table names, its feature revision and the fixes made
since the earlier revisions whose versions stay current, its schema and lineage, and the keys and hashes that
name a sample (docs/resize-bucket.md)."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas import FieldSpec, Lineage, TableSchema
from schemas.config import ResizeConfig
from schemas.fixes import (UNCLEANED_CAPTION, made_since, mask_may_misfit, mask_orientation_changes,
                           revisions_before, transparency_noted)
from stages.resize.sources import SourceSample
from stages.resize.split_rule import pictures_id
from store.row_rule import AnyOf, ColumnRule, RowRule


STAGE = "resize-bucket"
TABLE = "images"
# Bump when this stage's output changes for identical inputs and settings (new resampling, PNG options...).
FEATURE_REVISION = 4


def _caption_changes(rows: pa.Table) -> np.ndarray:
    """Stored captions revision 3 renders otherwise: '' (a copy kept instead of its rejected first copy) or one
    holding a control character or CR (cleaned since, so keyed anew), matched over the whole column."""
    if "caption" not in rows.column_names:
        return np.zeros(rows.num_rows, bool)
    col = rows.column("caption")
    hit = pc.or_(pc.equal(col, ""), pc.match_substring_regex(col, UNCLEANED_CAPTION))
    return pc.fill_null(hit, False).to_numpy(zero_copy_only=False)


# Each earlier revision whose versions stay current, with the fix made after it: which stored samples that fix
# renders differently (schemas/fixes.py), asked over whole columns (store/row_rule.py). A version of revision r
# is carried forward but for the samples any fix made since r changes: only those are re-rendered (`fixed_since`).
# 1 -> 2: a mask drawn on an EXIF-rotated target's stored pixels was stretched (e532fe5).
MASK_FIX = RowRule(mask_orientation_changes, ("has_mask", "conversions"))
# 2 -> 3: a mask of another aspect than its target was stretched (18eac2c: bad-mask since), captions kept control
# characters (cc89fbf), a copy kept instead of its rejected first copy was stored with caption '' (7016b9b)
REVISION_3_FIX = AnyOf((RowRule(mask_may_misfit, ("has_mask", "conversions")),
                        ColumnRule(_caption_changes, ("caption",))))
# 3 -> 4: a picture with one transparent colour (a PNG's tRNS on RGB/L/1/16-bit grey) kept that colour's pixels as
# stored instead of taking them as transparent (features/decode.py). No stored column tells such a picture (the rows
# record neither the pictures' formats nor their transparency; `source` names the target's file, not a control's,
# and a parquet cell no file at all): every row may change, so no revision-3 version stays current; the rerun reads
# each sample's source pictures' headers (no pixel decoded: header_checks.py) and renders again only those with a
# transparent colour, the others carried (`TOLD_BY_SOURCE`); the encoders encode again only rows whose new render
# notes it (`took_transparent_colour`)
REVISION_4_FIX = ColumnRule(lambda rows: np.ones(rows.num_rows, bool), ())
FIXES = ((1, MASK_FIX), (2, REVISION_3_FIX), (3, REVISION_4_FIX))
# the fixes whose rows the source's bytes settle, not the stored columns: a row only they select is carried when
# its pictures' headers say the fix leaves it unchanged (header_checks.py)
TOLD_BY_SOURCE = (REVISION_4_FIX,)


def fixed_since(revision: int, by_rows: bool = False) -> AnyOf:
    """Which samples of a version of `revision` the fixes made since render differently (`by_rows`: those the
    stored columns tell, without the rows the source's headers settle: `TOLD_BY_SOURCE`)."""
    return AnyOf(tuple(rule for rule in made_since(FIXES, revision) if not (by_rows and rule in TOLD_BY_SOURCE)))


def told_by_source_since(revision: int) -> bool:
    """Does a fix made since `revision` leave it to the source's headers which samples it changes?"""
    return any(rule in TOLD_BY_SOURCE for rule in made_since(FIXES, revision))


def _revisions_before_fixes() -> list[int]:
    """The earlier revisions whose versions stay current (oldest first)."""
    return revisions_before(FIXES, FEATURE_REVISION)


def lineages_before_fixes(lineage: Lineage) -> list[tuple[int, Lineage]]:
    """(revision, this run's version lineage as it hashed) for each earlier revision whose versions stay current."""
    from schemas.pictures_lineage import images_code_version

    return [(r, replace(lineage, code_version=images_code_version(r))) for r in _revisions_before_fixes()]


def pictures_before_fixes(schema: TableSchema) -> list[tuple[int, str]]:
    """(revision, pictures' feature lineage) of each earlier revision, as this run's schema records them."""
    from schemas.pictures_lineage import CODE_BEFORE_FIXES_ATTR, images_revision, recorded_before_fixes
    from store.reuse import FEATURE_LINEAGE_ATTR, LINEAGE_BEFORE_FIXES_ATTR

    now = schema.attrs[FEATURE_LINEAGE_ATTR]
    pairs = recorded_before_fixes(schema.attrs.get(LINEAGE_BEFORE_FIXES_ATTR), schema.attrs.get(CODE_BEFORE_FIXES_ATTR))
    return [(r, h) for r, h in ((images_revision(c), h) for c, h in pairs) if r is not None and h != now]


def pictures_now(schema: TableSchema) -> tuple[str, ...]:
    """This run's pictures' feature lineage, then, where it differs, the same pictures' as recorded before unread
    settings were hashed as their defaults (`schemas.pictures_lineage.earlier_pictures_lineage`): both name the
    samples carried as rendered with the same pixel settings. Computed once a run (it hashes the settings twice)."""
    from schemas.pictures_lineage import earlier_pictures_lineage
    from store.reuse import FEATURE_LINEAGE_ATTR

    earlier = earlier_pictures_lineage(ResizeConfig.model_validate(schema.attrs["resize"]),
                                       schema.lineage.code_version)
    return (schema.attrs[FEATURE_LINEAGE_ATTR], *filter(None, [earlier]))


# a row whose picture had transparency renders otherwise under the other resize.keep_alpha (schemas/fixes.py)
TRANSPARENCY_NOTED = RowRule(transparency_noted, ("conversions",))


def pictures_other_alpha(schema: TableSchema) -> tuple[str, ...]:
    """The pictures' feature lineage of this run's settings but resize.keep_alpha (`other_alpha_lineages`): an
    earlier version's samples of it are this run's but for the rows `TRANSPARENCY_NOTED` selects."""
    from schemas.pictures_lineage import other_alpha_lineages
    from store.reuse import FEATURE_LINEAGE_ATTR

    return other_alpha_lineages(schema.attrs.get("resize"), schema.attrs.get(FEATURE_LINEAGE_ATTR),
                                schema.lineage.code_version, ())


def images_schema(rc: ResizeConfig, listing: str, source: str = "", source_format: str = "") -> TableSchema:
    from schemas.lineage import unhashed_names
    from schemas.pictures_lineage import CODE_BEFORE_FIXES_ATTR, images_code_version, pictures_lineage
    from stages.resize.split_rule import ATTR as SPLIT_ATTR
    from stages.resize.split_rule import FOR_NEW_STORE
    from store.reuse import FEATURE_LINEAGE_ATTR, LINEAGE_BEFORE_FIXES_ATTR

    lineage = Lineage(stage=STAGE, config_hash=f"{rc.fingerprint()}-src{listing}",
                      code_version=images_code_version(FEATURE_REVISION))
    before_fixes = lineages_before_fixes(lineage)
    png, col = "png", "column"
    return TableSchema(
        name=TABLE,
        lineage=lineage,
        fields=(
            FieldSpec("target.png", png, kind="file"),
            FieldSpec("control_{i}.png", png, kind="file", optional=True),
            FieldSpec("control_{i}_vl.png", png, kind="file", optional=True),
            FieldSpec("mask.png", png, kind="file", optional=True),
            FieldSpec("caption", "string", kind=col),
            FieldSpec("split", "string", kind=col),
            FieldSpec("img_shapes", "json", kind=col),
            FieldSpec("bucket", "json", kind=col),
            FieldSpec("control_sizes", "json", kind=col),
            FieldSpec("control_vl_sizes", "json", kind=col),
            FieldSpec("num_controls", "int64", kind=col),
            FieldSpec("source", "string", kind=col),
            FieldSpec("source_hashes", "json", kind=col),
            FieldSpec("source_size", "json", kind=col),
            FieldSpec("has_mask", "bool", kind=col),
            FieldSpec("mask_sha256", "string", kind=col, optional=True),
            FieldSpec("conversions", "json", kind=col, optional=True),
        ),
        # without the operational settings (shard size, workers), which change neither features nor lineage
        attrs={
            # the split rule apart (split_rule.ATTR): recorded also where it hashes as unset ("key")
            "resize": rc.model_dump(mode="json", exclude=unhashed_names(rc) | {"split_by"}),
            SPLIT_ATTR: rc.split_by or FOR_NEW_STORE,
            "source": source,
            "source_format": source_format,
            "source_listing": listing,
            # the pixels' settings, not the view (which samples, split labels)
            FEATURE_LINEAGE_ATTR: pictures_lineage(rc, lineage.code_version),
            # what these pixels were hashed as by each earlier revision (oldest first): the encoders carry their
            # samples encoded from such a table forward unless a fix made since changed the sample
            # (stages/encode/plan.py)
            LINEAGE_BEFORE_FIXES_ATTR: [pictures_lineage(rc, old.code_version) for _, old in before_fixes],
            CODE_BEFORE_FIXES_ATTR: [old.code_version for _, old in before_fixes],
        },
    )


def sample_key(target: bytes, controls: list[bytes], caption: str) -> str:
    """Content hash of the target bytes, each control's bytes in order and the instruction (32 hex chars).

    Every part is length-prefixed, so moving bytes between parts can never give the same key.
    """
    h = hashlib.sha256()
    for part in (target, *controls, caption.encode("utf-8")):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()[:32]


def mask_hash(mask: bytes | None) -> str:
    """The edit mask is not part of the key (DESIGN: key = target + controls + caption), so reuse compares it
    separately: sha256 of its bytes, "" for none."""
    return hashlib.sha256(mask).hexdigest() if mask is not None else ""


def pictures_of(rec: SourceSample) -> str | None:
    """`pictures_id` of a sample read (its bytes) or found with its record; None where neither is at hand."""
    if rec.known is not None and rec.known.source_hashes:
        return pictures_id(rec.known.source_hashes)
    if rec.target is None:
        return None
    return pictures_id(hashlib.sha256(b).hexdigest() for b in (rec.target, *rec.controls))


def mask_bits(mask: bytes | None) -> int:
    return int(mask_hash(mask)[:16], 16) if mask is not None else 0
