"""The version committed: its quarantine rows first, an empty result refused (its in-progress version removed),
then the version and the notes every later run reads with it (the tars / parquet files read, the pixel limit)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import UserError
from stages.resize.images_table import TABLE
from stages.resize.intake import Intake
from store.writer_commit import discard_version

if TYPE_CHECKING:
    from store import Store


def commit_version(st: Store, writer: Any, source: str | Path, intake: Intake) -> None:
    """Quarantine rows first, then the version (an empty result is the user's to fix, not a table: its in-progress
    version is removed, so the next run's takes this number, not the one after)."""
    summary = intake.summary
    st.add_quarantine_table(intake.rejects.table())
    if summary.written + summary.resumed + summary.reused == 0:
        discard_version(writer)  # it holds no sample: a schema.json only, and the records this run wrote
        if not intake.rejects:  # nothing read at all (e.g. a target/ holding only .DS_Store): no quarantine to see
            raise UserError(f"no sample found in source {source} (dotfiles such as .DS_Store are ignored); add the "
                            "samples and rerun (the layouts: docs/resize-bucket.md, 'Sources')")
        first = intake.rejects.first()  # every one is alike often enough (a nested layout, no captions): the line says why
        raise UserError(
            f"no usable sample in source {source}: {len(intake.rejects)} quarantined, e.g. {first['reason']}"
            f"{': ' + first['detail'] if first['detail'] else ''} (all in {summary.quarantine_file}); fix the source "
            "and rerun"
        )
    summary.version = writer.commit()  # its last shard committed first
    if intake.tars is not None and intake.tars.seen:  # after the commit: a kill before it leaves no record (read)
        from stages.resize.known_tars import note_value
        from store.version_notes import write_note

        value = note_value(intake.tars, intake.max_file_bytes, intake.max_caption_bytes)
        write_note(st, TABLE, summary.version, intake.tars.kind.note, value)
    if intake.max_image_pixels:  # every row rendered, resumed or carried is within it (pixel_limit.py)
        from stages.resize.pixel_limit import NOTE as PIXEL_NOTE
        from store.version_notes import write_note

        write_note(st, TABLE, summary.version, PIXEL_NOTE, intake.max_image_pixels)
    # this run's shards only, as `written` counts this run's samples: the version folder also holds an earlier
    # session's shards (`resumed`), carried forward ones (`reused`) and tars a killed session left unindexed
    summary.bytes_written = writer.written_bytes
