"""This run's lineage: the resize settings in force for the source (a parquet source's mask column resolved), its
summary notes, and the schema its version is found or opened under, from the source's listing (the local tars /
parquet files read for the first time hashed while read: first_read.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import TableSchema
from schemas.config import PipelineConfig, ResizeConfig
from stages.resize.content import Listing, content_listing_hash
from stages.resize.first_read import pending_tars, settling
from stages.resize.images_table import TABLE, images_schema, lineages_before_fixes
from stages.resize.parquet_source import columns_in_force

if TYPE_CHECKING:
    from store import Store


def settings_for_source(cfg: PipelineConfig, source: str | Path, fmt: str,
                        existing_store: bool) -> tuple[ResizeConfig, list[str], bool]:
    """(resize settings in force for the source, its summary notes, whether a parquet source's unset mask column
    is resolved later): the notes' refusals come before a store is made."""
    rc = cfg.resize
    # an unset parquet mask column: `mask` where the files have one, in the lineage as set so; into a store that
    # exists, resolved once this run's listing is known (`_mask_by_a_version`: an up-to-date rerun reads no footer)
    later = fmt == "parquet" and rc.columns.mask is None and existing_store
    if fmt == "parquet" and not later:
        rc = rc.model_copy(update={"columns": columns_in_force(source, rc.columns)})
    notes = [] if later else _source_notes(source, fmt, cfg.resize.columns, rc.columns)  # refused before a store
    return rc, notes, later


@dataclass
class RunLineage:
    """What this run's version is found or opened under: the resize settings and source notes in force, its
    schema, the listing lines its source hash was made of (settled before the commit: first_read.py) and the local
    tars / parquet files read for the first time (hashed while read: `pending`)."""

    rc: ResizeConfig
    notes: list[str]
    schema: TableSchema
    listing: Listing
    pending: frozenset[str]


def _provisional(rc: ResizeConfig, source: str | Path, fmt: str, tars: frozenset[str]) -> tuple[TableSchema, Listing]:
    """The schema under a listing with `tars` standing for their stat stamps, and that listing's lines."""
    listing = Listing()  # its lines kept: the lineage is settled from them (first_read.py)
    return lineage_schema(rc, content_listing_hash(source, tars, listing), source, fmt), listing


def lineage_schema(rc: ResizeConfig, listing: str, source: str | Path, fmt: str) -> TableSchema:
    """The schema of this run's version under the listing hash `listing` (`_supersede_earlier_revision`)."""
    return _supersede_earlier_revision(images_schema(rc, listing, source=str(source), source_format=fmt))


def this_runs_lineage(cfg: PipelineConfig, rc: ResizeConfig, notes: list[str], st: Store, source: str | Path,
                      fmt: str, mask_later: bool) -> RunLineage:
    """What this run's version is found or opened under (`RunLineage`); `mask_later`: `settings_for_source`'s."""
    # local tars / parquet files read for the first time: hashed while read, the lineage settled at the commit
    pending = pending_tars(st, source, fmt)
    schema, listing = _provisional(rc, source, fmt, pending)
    if mask_later:
        rc, notes = _mask_by_a_version(st, rc, source, pending, listing.hash()) or \
            _mask_from_footers(rc, source, cfg.resize.columns)
        schema = lineage_schema(rc, listing.hash(), source, fmt)
    # a run killed between caching the streamed hashes and rewriting schema.json: its tars taken as pending again
    if (killed := settling(st, fmt, pending, schema.to_dict(), partial(_provisional, rc, source, fmt))) is not None:
        pending, (schema, listing) = killed
    return RunLineage(rc, notes, schema, listing, pending)


def _supersede_earlier_revision(schema: TableSchema) -> TableSchema:
    """`store repair` of a version rendered before this revision's fixes (its lineage is this run's under an earlier
    revision): the samples re-rendered are this revision's, so this run writes under its own lineage and schema
    (store/repair_context.py `supersede`) - a new version re-rendering the damaged samples and those the fixes
    change, the rest carried - and the next run reuses every sample. Before, they were written under the old
    revision's lineage and the next run re-rendered them again. Returns `schema`."""
    from store import repair_context

    if any(old == repair_context.expected() and old != schema.lineage
           for _, old in lineages_before_fixes(schema.lineage)):
        repair_context.supersede(schema.lineage)
    return schema


def _mask_by_a_version(st: Store, rc: ResizeConfig, source: Any, pending: frozenset[str],
                       listing: str) -> tuple[ResizeConfig, list[str]] | None:
    """An unset parquet mask column resolved without a footer read: by a complete version of this very listing (the
    same bytes or, at a URL, the same size and content tag: the same footers) made with `mask` read, or with none
    read under the rule (its note's `mask_rule`; a version made before the rule, from a file with a `mask` column,
    recorded none too). None where no such version is (files read for the first time, a store repair): the
    footers say."""
    from stages.resize.known_tars import MASK_RULE, PARQUET_NOTE
    from stages.resize.parquet_source import MASK_COLUMN
    from store import repair_context
    from store.version_notes import read_note

    if pending or repair_context.active():
        return None
    for mask in (MASK_COLUMN, None):
        cand = rc.model_copy(update={"columns": rc.columns.model_copy(update={"mask": mask})})
        found = st.find_version(TABLE, images_schema(cand, listing, source=str(source),
                                                     source_format="parquet").lineage)
        if found is None:
            continue
        note = read_note(st, TABLE, found, PARQUET_NOTE)
        if mask is not None or isinstance(note, dict) and note.get("mask_rule") == MASK_RULE:
            return cand, [_mask_read_line(mask)] if mask else []
    return None


def _mask_from_footers(rc: ResizeConfig, source: Any, columns: Any) -> tuple[ResizeConfig, list[str]]:
    rc = rc.model_copy(update={"columns": columns_in_force(source, rc.columns)})
    return rc, _source_notes(source, "parquet", columns, rc.columns)


def _mask_read_line(mask: str) -> str:
    return (f"parquet: column {mask!r} read as the edit mask (resize.columns.mask unset reads a column of that name; "
            "set resize.columns.mask to '' to read none)")


def _source_notes(source: Any, fmt: str, columns: Any, in_force: Any) -> list[str]:
    """A parquet source's summary lines: the mask column read although no setting named it, and the columns
    holding image bytes that nothing reads (a second control, a mask under another name): named, not dropped
    unsaid."""
    if fmt != "parquet":
        return []
    from stages.resize.parquet_source import parquet_files, unread_columns_line, unread_image_columns

    notes = []
    if columns.mask is None and in_force.mask:
        notes.append(_mask_read_line(in_force.mask))
    if unread := unread_image_columns(source, columns):  # as read: an unset mask judged per file
        notes.append(unread_columns_line(unread, len(parquet_files(source))))
    return notes
