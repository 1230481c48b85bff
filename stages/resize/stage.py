"""Stage resize-bucket: a source dataset -> the `images` table (resized PNGs, caption, bucket, img_shapes, split).

Read top to bottom: validate config -> lineage (resize settings + source listing: run_lineage.py; the table's
schema, revision and keys: images_table.py) -> up to date? (earlier_versions.py) -> open the resumable writer ->
for each source sample (render_loop.py): judge it (caption, control count, duplicate: judge.py), decode and
sanitise its images, resize target / control views / mask to their buckets (rendering.py), add (intake.py) ->
carry forward what an earlier version rendered alike (carried.py) -> quarantine the rejects -> commit (commit.py)
-> the summary (summary.py). Nothing bad in the input stops the run and nothing vanishes: every rejected sample
becomes one quarantine row (source path, reason, detail) and the summary counts them. Decisions are written down
in docs/resize-bucket.md.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.config import PipelineConfig, ResizeConfig
from schemas import UserError
from schemas.img_shapes import PIXELS_PER_PATCH
from schemas.resize_sizes import sizes_in_force
from stages.resize.bucketing import BucketRule, largest_bucket
from stages.resize.carried import carry_samples, refuse_a_switch_without_hashes
from stages.resize.commit import commit_version
from stages.resize.first_read import record_pending, settle_listing
from stages.resize.earlier_versions import adopted, damaged_current, reusable_renders, say_why_new, up_to_date_version
from stages.resize.folder_listing import remembered
from stages.resize.images_table import TABLE, pictures_now
from stages.resize.intake import Intake
from stages.resize.parquet_source import remembered_footers
from stages.resize.render_loop import render_source
from stages.resize.run_lineage import RunLineage, lineage_schema, settings_for_source, this_runs_lineage
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
    from store import Store  # here, where a run starts: the render workers import rendering.py alone

    check_config(cfg.resize)
    # an existing --store path is checked first (a file is refused by Store); a missing one is created only once
    # the source is known to be there (a typo in --source left an empty store behind)
    st = store if isinstance(store, Store) else Store(store) if Path(store).exists() else None
    source = _named_source(source)
    started = time.perf_counter()
    fmt = detect_format(source)
    rc, notes, mask_later = settings_for_source(cfg, source, fmt, existing_store=st is not None)
    st = st if st is not None else Store(store)
    # the store's split rule unless resize.split_by sets one: its samples keep their splits (split_rule.py)
    rc = rc.model_copy(update={"split_by": rule_in_force(st, rc.split_by)})
    lineage = this_runs_lineage(cfg, rc, notes, st, source, fmt, mask_later)
    found, newer = up_to_date_version(st, lineage.schema)
    if found is not None:
        return up_to_date_summary(st, found, newer, lineage.rc, source, lineage.notes, started)
    return _write_version(cfg, st, source, fmt, lineage, started)


def _write_version(cfg: PipelineConfig, st: Store, source: str | Path, fmt: str, lineage: RunLineage,
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
                     lineage: RunLineage, now: tuple[str, ...], started: float) -> ResizeSummary | None:
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
                       lambda hashed: lineage_schema(rc, hashed, source, fmt), frozenset(intake.unread))
        if intake.unread and (kept := _same_version(st, writer)) is not None:
            # the unread files read again fail alike, nothing else changed: no new version (still_unreadable.py)
            st.add_quarantine_table(intake.rejects.table())  # equal rows are not repeated; another OS error is recorded
            discard_version(writer)
            return kept_summary(st, kept, intake.summary, sorted(intake.unread), started)
    commit_version(st, writer, source, intake)
    return None


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
    from stages.resize.shards import is_shard_list
    from store.remote import is_url

    if is_url(source) or "::" in str(source):
        return str(source)
    if is_shard_list(source):  # a brace list: resolve its folder, keep the pattern
        p = Path(source)
        return str(p.parent.resolve() / p.name)
    return Path(source).resolve()


def check_config(rc: ResizeConfig) -> None:
    """What the resize section alone refuses: at the stage's start, and by the commands right after parsing
    (`run resize-bucket`, `run all`: a usage mistake, exit 2)."""
    if rc.multiple % PIXELS_PER_PATCH:
        raise UserError(f"resize.multiple = {rc.multiple} must be a multiple of {PIXELS_PER_PATCH} (VAE 8 x patch 2)")
    if rc.min_controls > rc.max_controls:
        raise UserError(f"resize.min_controls = {rc.min_controls} is above resize.max_controls = {rc.max_controls}")
    _check_bucket_sizes(rc)


# the largest bucket a run may render, unless resize.max_image_pixels reads larger pictures: a bucket past it was
# a typo (an area with zeros too many, a huge multiple or min_side) that every worker met as a MemoryError or the
# out-of-memory killer, a traceback or a SIGKILL per sample, instead of one line
BUCKET_PIXELS = 64 * 1024 * 1024


def _check_bucket_sizes(rc: ResizeConfig) -> None:
    cap = max(rc.max_image_pixels, BUCKET_PIXELS)
    views = {"target_area": rc.target_area, "control_vae_area": rc.control_vae_area}
    if rc.vl_views:
        views["control_vl_area"] = rc.control_vl_area
    for key, area in views.items():
        hw = largest_bucket(BucketRule(area, rc.multiple, rc.max_aspect, rc.min_side), rc.max_image_pixels)
        if hw is None or hw[0] * hw[1] > cap:
            size = "too large to compute" if hw is None else f"{hw[0]}x{hw[1]} = {hw[0] * hw[1]} px"
            raise UserError(
                f"resize.{key} = {area} with resize.multiple {rc.multiple}, min_side {rc.min_side} and max_aspect "
                f"{rc.max_aspect} gives buckets of up to {size}, over the {cap} px a bucket may hold (the larger of "
                f"resize.max_image_pixels and {BUCKET_PIXELS}): lower those settings (Qwen-Image-Edit trains at "
                f"~1048576 px), or raise resize.max_image_pixels for larger buckets")
