"""The loop over the source: each sample triaged (resumed, carried forward, quarantined or rendered), the ones to
render rendered in `resize.workers` processes (render_pool.py) and added to the version, then the copies revived
for first copies the rendering rejected."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from tqdm import tqdm

from schemas.config import ResizeConfig
from schemas.errors import Rejected
from schemas.fixes import KEPT_INSTEAD
from stages.resize.caption_text import clean_caption
from stages.resize.images_table import STAGE, mask_bits, mask_hash
from stages.resize.intake import Intake
from stages.resize.judge import claim, judge, judge_known
from stages.resize.render_pool import rendered_in_order
from stages.resize.rendering import Rendered, bucket_rules, render_item
from stages.resize.sources import SourceSample, iter_source

if TYPE_CHECKING:
    from store import Store


def render_source(source: str | Path, fmt: str, rc: ResizeConfig, writer: Any, rendered_before: dict[str, str],
                  colour_checked: set[str], intake: Intake, st: Store, pending: frozenset[str] = frozenset(),
                  read_columns: Any = None) -> dict[str, str]:
    """Judge every source sample, render the new ones in `rc.workers` processes and add them to the writer.
    Returns key -> source of the samples to carry forward from an earlier version instead (those of
    `colour_checked` once their pictures' headers say so: header_checks.py). `read_columns`: the
    parquet mapping as set (rc.columns by default): an unset mask is judged per file (a file whose `mask` column
    holds no image bytes has no masks), where rc.columns, as the lineage records it, names `mask` once any file
    holds it."""
    from models.file_hashes import FileHashes
    from stages.resize.known_sources import known_sources
    from stages.resize.known_tars import Kind, known_tars, parquet_kind
    from stages.resize.frame_limit import frames_over
    from stages.resize.header_checks import HeaderChecks
    from stages.resize.pixel_limit import PixelLimit, pixel_limit
    from stages.resize.recorded_resize import recorded_resize

    # carried samples are not decoded: those last checked under a higher resize.max_image_pixels or
    # max_image_frames are checked here (each version's recorded limits read once for both), and those rendered
    # before revision 4 for a transparent colour, from their headers
    if rendered_before:
        recorded = recorded_resize(st)
        limit, over = pixel_limit(st, rc.max_image_pixels, recorded), frames_over(st, rc.max_image_frames, recorded)
    else:
        limit, over = PixelLimit(rc.max_image_pixels), set()
    header_checks = HeaderChecks(limit, colour_checked, over)
    intake.max_image_pixels = rc.max_image_pixels
    with FileHashes() as hashes:
        # samples of a folder or JSONL source the newest version holds, their files unchanged: carried, not read;
        # of a webdataset or parquet source, whole tars / parquet files (known_tars.py)
        known = known_sources(st, rendered_before, hashes, rc.max_file_bytes) if fmt in ("folder", "jsonl") else \
            known_tars(st, rendered_before, hashes, rc.max_file_bytes,
                       Kind() if fmt == "webdataset" else parquet_kind(rc.columns), rc.max_caption_bytes)
        intake.tars, intake.max_file_bytes = (known if fmt in ("webdataset", "parquet") else None), rc.max_file_bytes
        intake.max_caption_bytes = rc.max_caption_bytes
        if intake.tars is not None:
            intake.tars.pending = pending
        return _render_samples(source, fmt, rc, writer, rendered_before, intake, known, header_checks, read_columns)


def _render_samples(source: str | Path, fmt: str, rc: ResizeConfig, writer: Any, rendered_before: dict[str, str],
                    intake: Intake, known: Any, header_checks: Any, read_columns: Any = None) -> dict[str, str]:
    """Read the source, triage each sample (`_Triage`), render those to render in `rc.workers` processes and add
    them to the writer, then the copies revived for rejected first copies. Returns the samples to carry forward."""
    from stages.resize.resumed_sources import resumed_sources
    from stages.resize.source_count import count_samples

    done = resumed_sources(writer.dir) if writer.done_keys else {}
    triage = _Triage(rc, writer, rendered_before, intake, header_checks, done)
    render_one = partial(render_item, rc=rc, rules=bucket_rules(rc))
    columns = read_columns if read_columns is not None else rc.columns
    with tqdm(desc=f"{STAGE} ({fmt})", unit="sample", total=count_samples(source, fmt, known),
              dynamic_ncols=True) as bar:
        records = iter_source(source, rc.max_file_bytes, columns, done, known, rc.max_caption_bytes)
        # at most 2 x workers samples in flight: memory stays bounded whatever the dataset size; a worker that
        # dies (out of memory, a crash in an image library) costs its sample, not the run (render_pool.py)
        for (rec, key, _), out in rendered_in_order(render_one, triage.to_render(bar, records), rc.workers,
                                                    ahead=2 * rc.workers,
                                                    on_crash=_worker_died):
            intake.store(writer, rec, key, out)
        _revive(intake, writer, rendered_before, header_checks, triage.carry, rc, render_one)
        if bar.total != bar.n:  # orphans / unreadable entries counted differently: end at 100 %
            bar.total = bar.n
            bar.refresh()
    return triage.carry


@dataclass
class _Triage:
    """Where each source sample goes: resumed (in the interrupted run's committed shards), carried forward from an
    earlier version (`carry`: key -> source), quarantined (`intake`), or rendered (`to_render` yields it)."""

    rc: ResizeConfig
    writer: Any
    rendered_before: dict[str, str]
    intake: Intake
    header_checks: Any
    done: Any  # source -> key of the resumed version's samples (resumed_sources.py)
    carry: dict[str, str] = field(default_factory=dict)

    def to_render(self, bar: tqdm, records: Iterator[SourceSample]) -> Iterator[tuple[SourceSample, str, str]]:
        for rec in records:
            bar.update()  # by hand: a tqdm iterated closes itself when exhausted, before the total is settled
            rec = self._with_bytes_if_needed(rec)
            try:
                judged = self._judged(rec)
            except Rejected as r:
                self._rejected(rec, r)
                bar.set_postfix(quarantined=len(self.intake.rejects))
                continue
            if judged is not None and (item := self._placed(rec, *judged)) is not None:
                yield item

    def _with_bytes_if_needed(self, rec: SourceSample) -> SourceSample:
        """`rec` with the key the resumed version holds under its source; re-read when found by its recorded key
        but not to be carried unread."""
        if rec.done_key is None and rec.problem is None:  # a reader that read it anyway (a parquet row)
            rec.done_key = self.done.get(rec.source)
        if rec.known is not None and rec.done_key is None and not _carried_unread(
                rec, self.writer, self.rendered_before, self.intake, self.header_checks):
            # a copy of a key met before, one a resumed run holds, or one perhaps over a lowered
            # resize.max_image_pixels: judged from its bytes
            return rec.reread()
        return rec

    def _judged(self, rec: SourceSample) -> tuple[str, str] | None:
        """(key, caption) of a sample read now; None for one resumed or carried by its recorded key. Raises
        Rejected."""
        intake = self.intake
        if rec.done_key is not None:  # written before: same source name, same bytes (the lineage)
            claim(rec.done_key, rec.source, intake.first_source)
            intake.summary.resumed += 1
            return None
        if rec.known is not None:
            key = judge_known(rec, self.rc, intake.first_source)
            if rec.known.mask_sha256:
                intake.first_mask[key] = int(rec.known.mask_sha256[:16], 16)  # as mask_bits of its bytes
            self.carry[key] = rec.source
            return None
        return judge(rec, self.rc, intake.first_source)

    def _rejected(self, rec: SourceSample, r: Rejected) -> None:
        intake, writer = self.intake, self.writer
        if r.reason == "duplicate":
            intake.duplicate(rec, r, first_kept=intake.first_kept(writer, r.key, self.carry),
                             holder=r.key in intake.revived_before and intake.holds(writer, r.key, rec))
        else:
            intake.reject(rec, r)

    def _placed(self, rec: SourceSample, key: str, caption: str) -> tuple[SourceSample, str, str] | None:
        """A judged sample: resumed, carried forward, or to render (returned)."""
        intake, writer = self.intake, self.writer
        if rec.mask is not None:
            intake.first_mask[key] = mask_bits(rec.mask)
        if key in writer.done_keys and intake.holds(writer, key, rec):
            intake.summary.resumed += 1
        elif key in writer.done_keys:  # a later copy holds it: this first copy's rendering failed before
            intake.revived_before.add(key)  # rendered again for its row; its copies judged as then
            return rec, key, caption
        elif _rendered_alike(rec, key, self.rendered_before, self.header_checks):  # same content, mask
            self.carry[key] = rec.source
        else:
            return rec, key, caption
        return None


def _rendered_alike(rec: SourceSample, key: str, rendered_before: dict[str, str], header_checks: Any) -> bool:
    """An earlier version holds `key` rendered from the same content and mask, within the pixel limit now in force
    and rendered as this revision renders it (its headers: header_checks.py): carried forward, not rendered."""
    return rendered_before.get(key, None) == mask_hash(rec.mask) and header_checks.fits(key, rec)


def _revive(intake: Intake, writer: Any, rendered_before: dict[str, str], header_checks: Any,
            carry: dict[str, str], rc: ResizeConfig, render_one: Any) -> None:
    """First copies the rendering rejected (a bad mask): their next copy instead, in rounds (the i-th held copy of
    every key not yet kept), so the table does not depend on the worker count."""
    pending = intake.revivals()
    while pending:
        items = []
        for key, recs in pending.items():
            rec, row = recs.pop(0)
            intake.take_back(key, rec, row)
            if intake.holds(writer, key, rec):  # the copy the interrupted run revived: in the table already
                intake.summary.resumed += 1
                intake.kept_instead(key, rec, recs + intake.superseded.pop(key, []))
                recs.clear()
            elif _rendered_alike(rec, key, rendered_before, header_checks):
                carry[key] = rec.source
                intake.kept_instead(key, rec, recs)
            else:  # its caption as its first copy's (the same key): the row's instruction, not ""
                items.append((rec, key, clean_caption(rec.caption)))
        for (rec, key, _), out in rendered_in_order(render_one, items, rc.workers, ahead=2 * rc.workers,
                                                    on_crash=_worker_died):
            if intake.store(writer, rec, key, _kept_instead(out)):
                intake.kept_instead(key, rec, pending[key])
        pending = {k: recs for k, recs in pending.items()
                   if recs and k not in carry and k not in writer.carried_keys}
    intake.settle_revivals()


def _kept_instead(out: Rendered | Rejected) -> Rendered | Rejected:
    """A copy rendered instead of its rejected first copy: its row says so (`KEPT_INSTEAD`: how the encoders tell
    the rows that revision 3 renders differently, schemas/fixes.py)."""
    if isinstance(out, Rejected):
        return out
    notes = [*out.notes, KEPT_INSTEAD]
    return replace(out, meta={**out.meta, "conversions": sorted(set(notes))}, notes=notes)


def _carried_unread(rec: SourceSample, writer: Any, rendered_before: dict[str, str], intake: Intake,
                    header_checks: Any) -> bool:
    """Can a sample found with its recorded key (known_sources.py) take the carry-forward branch below as read
    samples do, without its bytes? Not a copy of a key met before (a duplicate may be held for a revival, which
    renders it), a key the resumed version holds (judged by its mask), nor one whose images may be over a
    resize.max_image_pixels lowered since it was checked (pixel_limit.py) or hold a transparent colour (revision 4),
    unless their headers, read from their first bytes (`rec.heads`), say they are not (header_checks.py)."""
    key = rec.known.key
    return key not in intake.first_source and key not in writer.done_keys \
        and rendered_before.get(key) == rec.known.mask_sha256 and header_checks.unread_ok(key, rec.heads)


def _worker_died(item: tuple[SourceSample, str, str]) -> Rejected:
    rec, key, _ = item
    return Rejected("worker-died", f"the worker process rendering this sample ended (killed, e.g. out of memory: "
                    f"lower resize.workers or resize.max_image_pixels; or a crash in an image library), also when "
                    f"it rendered this sample alone; files: {', '.join(rec.files) or rec.source}", key=key)
