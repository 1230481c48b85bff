"""What a resize-bucket run learns sample by sample (`Intake`): the summary's counts, the quarantine rows, each
key's first copy, and the duplicates held for a revival should that copy's rendering fail."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from schemas.errors import Rejected
from stages.resize.images_table import STAGE, mask_bits, pictures_of
from stages.resize.reject_rows import RejectRows
from stages.resize.rendering import Rendered
from stages.resize.sources import SourceSample
from stages.resize.summary import ResizeSummary


HELD_PER_KEY = 4


@dataclass
class Intake:
    """What the run learns sample by sample: the summary's counts, the quarantine rows, and the source of each
    key's first occurrence (a duplicate names it)."""

    summary: ResizeSummary
    rejects: RejectRows = field(default_factory=RejectRows)
    first_source: dict[str, str] = field(default_factory=dict)
    # key -> the first copy's mask, for first copies with one: 64 bits of its hash (36 B, the hex string 113 B per
    # masked sample; a collision only leaves a duplicate dropped, as before)
    first_mask: dict[str, int] = field(default_factory=dict)
    # Duplicates with another mask than their first copy, while that copy's rendering is not known to succeed:
    # if it is rejected (a bad mask), the first of these is rendered instead (`revivals`), not lost as a
    # "duplicate" of a sample the table does not hold. A few per key: bounded whatever the source.
    held: dict[str, list[tuple[SourceSample, int]]] = field(default_factory=dict)  # each with its row's number
    failed: set[str] = field(default_factory=set)  # keys whose (first) copy was rejected while rendering
    # A resumed run's keys that the interrupted run kept under a later copy than their first (the first's
    # rendering failed there, a copy held for it was revived): judged as then, up to that copy (`holds`)
    revived_before: set[str] = field(default_factory=set)
    # key -> copies rendered now that failed in the interrupted run (a worker that died): their key is held by
    # the copy it revived instead, which their rows name once it is met
    superseded: dict[str, list[tuple[SourceSample, int]]] = field(default_factory=dict)
    masks: Any = None  # resumed_sources.ResumedMasks of the resumed version, read when first needed
    tars: Any = None  # known_tars.KnownTars of a webdataset or parquet source: its files' record, with the version
    max_file_bytes: int = 0  # resize.max_file_bytes the tars were read under (recorded with them)
    max_caption_bytes: int = 0  # resize.max_caption_bytes, as max_file_bytes
    max_image_pixels: int = 0  # the limit every row of the version is within (recorded with it: pixel_limit.py)
    # local files a read error kept from being read whole (`read-error`): the version's listing does not count
    # them as read (first_read.settle_listing), so a rerun reads them again
    unread: set[str] = field(default_factory=set)
    # the (kept, dropped) pairs the revivals let go, dropped from `summary.duplicates` at once by
    # `settle_revivals`: the count of each
    pairs_gone: Counter = field(default_factory=Counter)

    def reject(self, rec: SourceSample, r: Rejected) -> int:
        """The quarantine row of `rec`, counted; its number in `rejects`."""
        row = {"key": r.key, "source": rec.source, "stage": STAGE, "reason": r.reason, "detail": r.detail}
        if rec.samples > 1:  # one row for a range of unread rows: the column only there (older rows lack it)
            row["samples"] = rec.samples
        if r.key is not None and (pictures := pictures_of(rec)) is not None:  # its would-be split under either
            row["pictures"] = pictures  # rule (`run all`'s val check: pipeline/val_split.py); older rows lack it
        if rec.unread is not None:
            self.unread.add(rec.unread)
        n = self.rejects.add(row)
        self.summary.quarantined[r.reason] += rec.samples
        if r.reason == "duplicate" and r.key in self.first_source:
            self.summary.add_duplicate(self.first_source[r.key], rec.source)
        return n

    def first_kept(self, writer: Any, key: str, carry: dict[str, Any]) -> bool:
        """The first copy of `key` is in the table: written, carried forward, or resumed (unless the resumed
        version holds a later copy)."""
        return (key in writer.done_keys and key not in self.revived_before) or key in writer.carried_keys \
            or key in carry

    def holds(self, writer: Any, key: str, rec: SourceSample) -> bool:
        """`rec` is the copy of `key` the resumed version holds: the one written under its source name, or, where
        its source name is not found there (a source folder moved since), a copy with the recorded mask."""
        if rec.done_key is not None:
            return rec.done_key == key
        if key not in writer.done_keys:
            return False
        if self.masks is None:
            from stages.resize.resumed_sources import resumed_masks

            self.masks = resumed_masks(writer.dir)
        recorded = self.masks.get(key)
        return recorded is None or recorded == mask_bits(rec.mask)

    def duplicate(self, rec: SourceSample, r: Rejected, first_kept: bool, holder: bool = False) -> None:
        """A duplicate's quarantine row; held for a revival when its mask differs from the first copy's and that
        copy is not known to be kept (written, resumed or carried forward). `holder`: the copy a resumed version
        holds instead of its first (`revived_before`), held always: its revival finds it in the table."""
        row = self.reject(rec, r)
        if holder or (not first_kept and self.first_mask.get(r.key, 0) != mask_bits(rec.mask)):
            if len(held := self.held.setdefault(r.key, [])) < HELD_PER_KEY or holder:
                held.append((rec, row))

    def store(self, writer: Any, rec: SourceSample, key: str, out: Rendered | Rejected) -> bool:
        """Add the rendered sample to the table, or record why not; whether it is in the table now."""
        if isinstance(out, Rejected):
            self.failed.add(key)  # its duplicates judged later are held too: revived in source order at the end
            self.reject(rec, out)
            return False
        if key in writer.done_keys:  # a later copy holds it since the interrupted run: it stays, this is its duplicate
            self.failed.add(key)
            dup = Rejected("duplicate", "same content (target, controls, caption) as the copy the interrupted run kept "
                           "(this copy's rendering failed there)", key=key)
            self.superseded.setdefault(key, []).append((rec, self.reject(rec, dup)))
            return False
        self.held.pop(key, None)  # kept: its duplicates stay dropped
        writer.add(key, files=out.files, meta=out.meta)
        s = self.summary
        s.written += 1
        s.splits[out.meta["split"]] += 1
        s.buckets[tuple(out.meta["bucket"])] += 1
        s.controls[out.meta["num_controls"]] += 1
        s.conversions.update(out.notes)
        return True

    def revivals(self) -> dict[str, list[tuple[SourceSample, int]]]:
        """key -> its held duplicates (source order, each with its quarantine row), for each first copy the
        rendering rejected."""
        return {k: self.held.pop(k) for k in [k for k in self.held if k in self.failed]}

    def take_back(self, key: str, rec: SourceSample, row: int) -> None:
        """A held duplicate is rendered after all, and judged on its own: its "duplicate" row goes (its pair at
        `settle_revivals`: a search of the list per revived copy made 1M samples' revivals quadratic)."""
        self.rejects.drop(row)
        self.summary.quarantined["duplicate"] -= 1
        if not self.summary.quarantined["duplicate"]:  # not "duplicate 0" in the summary and --json
            del self.summary.quarantined["duplicate"]
        self.pairs_gone[(self.first_source[key], rec.source)] += 1

    def kept_instead(self, key: str, kept: SourceSample, later: list[tuple[SourceSample, int]]) -> None:
        """The revived copy `kept` is in the table: the later held copies are its duplicates."""
        for rec, row in later:
            self.rejects.set_detail(row, f"same content (target, controls, caption) as {kept.source}")
            self.pairs_gone[(self.first_source[key], rec.source)] += 1
            self.summary.add_duplicate(kept.source, rec.source)

    def settle_revivals(self) -> None:
        """Drop the pairs `take_back` and `kept_instead` let go, in one pass over the list (as one `list.remove`
        each: an equal pair's first occurrence goes); those past the pairs listed from the count only."""
        if self.pairs_gone:
            gone, kept = self.pairs_gone, []
            self.summary.duplicate_pairs -= sum(gone.values())
            for pair in self.summary.duplicates:
                if gone.get(pair, 0) > 0:
                    gone[pair] -= 1
                else:
                    kept.append(pair)
            self.summary.duplicates[:] = kept
            gone.clear()
