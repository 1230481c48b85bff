"""Stage resize-bucket: a source dataset -> the `images` table (resized PNGs, caption, bucket, img_shapes, split).

Read top to bottom: validate config -> lineage (resize settings + source listing) -> up to date? -> open the
resumable writer -> for each source sample: judge it (caption, control count, duplicate), decode and sanitise
its images, resize target / control views / mask to their buckets, add -> quarantine the rejects -> commit.
Nothing bad in the input stops the run and nothing vanishes: every rejected sample becomes one quarantine row
(source path, reason, detail) and the summary counts them. Decisions are written down in docs/resize-bucket.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.config import PipelineConfig, ResizeConfig
from schemas import TableSchema, UserError
from schemas.img_shapes import PIXELS_PER_PATCH
from schemas.resize_sizes import sizes_in_force
from stages.resize.carried import carry_samples, refuse_a_switch_without_hashes
from stages.resize.commit import commit_version
from stages.resize.content import Listing, content_listing_hash
from stages.resize.first_read import pending_tars, record_pending, settle_listing, settling
from stages.resize.earlier_versions import adopted, damaged_current, reusable_renders, say_why_new, up_to_date_version
from stages.resize.folder_listing import remembered
from stages.resize.images_table import TABLE, images_schema, lineages_before_fixes, pictures_now
from stages.resize.intake import Intake
from stages.resize.parquet_source import columns_in_force, remembered_footers
from stages.resize.render_loop import render_source
from stages.resize.sources import detect_format
from stages.resize.summary import ResizeSummary, committed_summary, kept_summary, up_to_date_summary
from stages.resize.split_rule import rule_in_force
from stages.resize.still_unreadable import same_version as _same_version
from store.writer_commit import discard_version

if TYPE_CHECKING:
    from store import Store


def run(cfg: PipelineConfig, source: str | Path, store: Store | str | Path) -> ResizeSummary:
    # a folder source is listed once for the listing hash, the bar's total and the reader (folder_listing.py); a
    # parquet file's footer read once for the bar's total, the column check and the reader (parquet_source.py)
    with remembered(), remembered_footers():
        return _run(cfg, source, store)


def _run(cfg: PipelineConfig, source: str | Path, store: Store | str | Path) -> ResizeSummary:
    from store import Store  # here, not at the top: render workers import this module and need no torch

    check_config(cfg.resize)
    # an existing --store path is checked first (a file is refused by Store); a missing one is created only once
    # the source is known to be there (a typo in --source left an empty store behind)
    st = store if isinstance(store, Store) else Store(store) if Path(store).exists() else None
    source = _named_source(source)
    started = time.perf_counter()
    fmt = detect_format(source)
    rc, notes, mask_later = _settings_for_source(cfg, source, fmt, existing_store=st is not None)
    st = st if st is not None else Store(store)
    # the store's split rule unless resize.split_by sets one: its samples keep their splits (split_rule.py)
    rc = rc.model_copy(update={"split_by": rule_in_force(st, rc.split_by)})
    lineage = _this_runs_lineage(cfg, rc, notes, st, source, fmt, mask_later)
    found, newer = up_to_date_version(st, lineage.schema)
    if found is not None:
        return up_to_date_summary(st, found, newer, lineage.rc, source, lineage.notes, started)
    return _write_version(cfg, st, source, fmt, lineage, started)


def _settings_for_source(cfg: PipelineConfig, source: str | Path, fmt: str,
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
class _Lineage:
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
    return _supersede_earlier_revision(images_schema(rc, content_listing_hash(source, tars, listing),
                                                     source=str(source), source_format=fmt)), listing


def _this_runs_lineage(cfg: PipelineConfig, rc: ResizeConfig, notes: list[str], st: Store, source: str | Path,
                       fmt: str, mask_later: bool) -> _Lineage:
    # local tars / parquet files read for the first time: hashed while read, the lineage settled at the commit
    pending = pending_tars(st, source, fmt)
    schema, listing = _provisional(rc, source, fmt, pending)
    if mask_later:
        rc, notes = _mask_by_a_version(st, rc, source, pending, listing.hash()) or \
            _mask_from_footers(rc, source, cfg.resize.columns)
        schema = _supersede_earlier_revision(images_schema(rc, listing.hash(), source=str(source), source_format=fmt))
    # a run killed between caching the streamed hashes and rewriting schema.json: its tars taken as pending again
    if (killed := settling(st, fmt, pending, schema.to_dict(), partial(_provisional, rc, source, fmt))) is not None:
        pending, (schema, listing) = killed
    return _Lineage(rc, notes, schema, listing, pending)


def _write_version(cfg: PipelineConfig, st: Store, source: str | Path, fmt: str, lineage: _Lineage,
                   started: float) -> ResizeSummary:
    """Open this run's version (or resume it), fill it and commit it; its summary. A run whose unread files fail
    alike again keeps the version it found instead (`kept_summary`)."""
    rc, schema = lineage.rc, lineage.schema
    now = pictures_now(schema)
    refuse_a_switch_without_hashes(st, rc, schema, now)
    repairing = damaged_current(st)
    say_why_new(st, schema, lineage.pending)
    moved = adopted(st, schema)
    writer = st.writer(TABLE, schema, shard_size_mb=rc.shard_size_mb)
    intake = Intake(ResizeSummary(version=writer.version, quarantine_file=str(st.root / "quarantine.parquet"),
                                  sizes=sizes_in_force(rc.model_dump()), source=str(source),
                                  source_notes=lineage.notes,
                                  source_before=moved.before if moved and moved.version == writer.version else ""))
    try:
        kept = _fill_and_commit(cfg, st, writer, intake, source, fmt, lineage, now, started)
    finally:
        writer.close()
    return kept if kept is not None else committed_summary(st, intake.summary, rc, repairing, started)


def _fill_and_commit(cfg: PipelineConfig, st: Store, writer: Any, intake: Intake, source: str | Path, fmt: str,
                     lineage: _Lineage, now: tuple[str, ...], started: float) -> ResizeSummary | None:
    """Render and carry every sample into `writer`, settle its lineage and commit it. None once committed; the
    kept version's summary when the files a read error left unread fail alike again (still_unreadable.py). `now`:
    `pictures_now`."""
    rc, pending = lineage.rc, lineage.pending
    record_pending(writer, pending)
    carry = render_source(source, fmt, rc, writer, *reusable_renders(st, lineage.schema, now), intake, st, pending,
                          read_columns=cfg.resize.columns)
    carry_samples(st, writer, lineage.schema, now, carry, intake.summary, rc)
    if intake.unread:
        _refuse_unread_repair(intake)
    if pending or intake.unread:  # before the commit: the lineage of the bytes streamed (first_read.py)
        settle_listing(writer, intake.tars.streamed if intake.tars is not None else {}, pending, lineage.listing,
                       lambda hashed: _supersede_earlier_revision(
                           images_schema(rc, hashed, source=str(source), source_format=fmt)),
                       frozenset(intake.unread))
        if intake.unread and (kept := _same_version(st, writer)) is not None:
            # the unread files read again fail alike, nothing else changed: no new version (still_unreadable.py)
            st.add_quarantine(intake.rejects)  # equal rows are not repeated; another OS error is recorded
            discard_version(writer)
            return kept_summary(st, kept, intake.summary, sorted(intake.unread), started)
    commit_version(st, writer, source, intake)
    return None


# ---------------------------------------------------------------- the steps of `run`


def _refuse_unread_repair(intake: Intake) -> None:
    """`store repair` rebuilds a damaged version under its own lineage, which says every file was read: with
    samples a read error kept out it would pass for whole. It stops instead; rerun it once the disk reads again."""
    from store import repair_context

    if repair_context.active():
        raise UserError(f"store repair: {intake.summary.quarantined['read-error']} source sample(s) could not be read "
                        f"(e.g. {sorted(intake.unread)[0]}: a disk, network or permission error; rows with reason "
                        "read-error in the quarantine); make the files readable and rerun the repair")


def _named_source(source: str | Path) -> str | Path:
    """A local path resolved (quarantine rows and schema attrs name the source unambiguously); a URL or a brace
    list of shards as given (a Path would fold `s3://` into `s3:/`)."""
    from stages.resize.shards import is_shard_list, is_url

    if is_url(source) or "::" in str(source):
        return str(source)
    if is_shard_list(source):  # a brace list: resolve its folder, keep the pattern
        p = Path(source)
        return str(p.parent.resolve() / p.name)
    return Path(source).resolve()


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


# ---------------------------------------------------------------- per sample


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


def check_config(rc: ResizeConfig) -> None:
    """What the resize section alone refuses: at the stage's start, and by the commands right after parsing
    (`run resize-bucket`, `run all`: a usage mistake, exit 2)."""
    if rc.multiple % PIXELS_PER_PATCH:
        raise UserError(f"resize.multiple = {rc.multiple} must be a multiple of {PIXELS_PER_PATCH} (VAE 8 x patch 2)")
    if rc.min_controls > rc.max_controls:
        raise UserError(f"resize.min_controls = {rc.min_controls} is above resize.max_controls = {rc.max_controls}")


