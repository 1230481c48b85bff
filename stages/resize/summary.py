"""What a resize-bucket run says it did (`ResizeSummary`: its lines and --json record), and the counts read back
from the version it committed or kept: splits, controls, buckets, val samples sharing a train sample's pictures,
identity edits."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from tqdm import tqdm

from schemas.config import ResizeConfig
from schemas.resize_sizes import sizes_in_force
from schemas.stage import quarantined_line
from schemas.units import count_text
from stages.resize.images_table import STAGE, TABLE
from stages.resize.moved_source import recorded_source

if TYPE_CHECKING:
    from pathlib import Path

    from store import Store


PAIRS_LISTED = 100  # duplicate pairs a summary lists: 5 named, the rest spare for those the revivals take back


@dataclass
class ResizeSummary:
    version: int
    up_to_date: bool = False
    stage: str = STAGE
    written: int = 0
    reused: int = 0  # carried forward from an earlier version with the same render settings (not re-rendered)
    resumed: int = 0  # already in committed shards from an interrupted run
    bytes_written: int = 0
    seconds: float = 0.0
    quarantined: Counter = field(default_factory=Counter)  # reason -> count
    conversions: Counter = field(default_factory=Counter)  # what sanitising did -> count
    splits: Counter = field(default_factory=Counter)
    buckets: Counter = field(default_factory=Counter)  # (h, w) of targets
    controls: Counter = field(default_factory=Counter)  # control images per sample -> samples (written, reused)
    quarantine_file: str = ""
    # (kept source, dropped source): the first PAIRS_LISTED pairs met (the summary names 5; every pair is a
    # quarantine row), and how many pairs in all (a pair each was ~140 B: 140 MB for 1M duplicates)
    duplicates: list[tuple[str, str]] = field(default_factory=list)
    duplicate_pairs: int = 0
    sizes: str = ""  # the sizes in force (schemas.resize_sizes)
    store: str = ""
    repaired_from: int | None = None  # the version recorded as damaged whose damaged samples this run re-rendered
    # a store URL: the higher version another writer made current meanwhile, which stays current over `version`
    newer_current: int | None = None
    source: str = ""  # where the source was read now
    # where the version reused or resumed was read from, when the same content lay elsewhere then (moved_source.py)
    source_before: str = ""
    # up to date because the files a read error kept out of the version failed again alike (still_unreadable.py)
    unreadable: list[str] = field(default_factory=list)
    # val samples whose target and controls a train sample has too (the pair under another caption: `val_sharing`)
    val_sharing: int = 0
    # samples whose target is one of their controls (the same bytes: `source_hashes`), and the first few sources
    identity_edits: int = 0
    identity_examples: list[str] = field(default_factory=list)
    split_by: str = ""  # the rule the version was split by (split_rule.py)
    # what the reader read that no setting named, and what it left unread (a parquet source: run_lineage.py `_source_notes`)
    source_notes: list[str] = field(default_factory=list)

    def add_duplicate(self, kept: str, dropped: str) -> None:
        """A (kept, dropped) pair, listed while every pair met so far is (`duplicates`: a prefix of them all)."""
        if len(self.duplicates) == self.duplicate_pairs < PAIRS_LISTED:
            self.duplicates.append((kept, dropped))
        self.duplicate_pairs += 1

    def to_json(self) -> dict[str, Any]:
        from schemas.stage import summary_record

        return summary_record(self.stage, TABLE, self.version, self.written, self.reused,
                              sum(self.quarantined.values()), self.bytes_written, self.seconds, self.up_to_date,
                              resumed=self.resumed, splits=dict(self.splits),
                              quarantined_by_reason=dict(self.quarantined), repaired_from=self.repaired_from,
                              newer_current=self.newer_current, source_before=self.source_before or None,
                              val_sharing_train_images=self.val_sharing, identity_edits=self.identity_edits,
                              split_by=self.split_by or None)

    def _val_sharing_line(self) -> str:
        # only under the key rule: the pictures rule puts every caption of a pair in one split
        return (f"val: {self.val_sharing} of {self.splits['val']} val samples have the target and controls of a train "
                "sample (the same pair under another caption): the held-out loss is measured on pictures trained on, "
                "and evaluate's best checkpoint favours memorising them; this store splits by key (its rule when "
                "made); rerun with `--set resize.split_by=pictures` to split by the pictures alone (a new images "
                "version: samples move between splits, the encoders carry their features; train and evaluate anew)")

    def _identity_line(self) -> str:
        return (f"{self.identity_edits} of {count_text(self.splits.total(), 'sample')} have a control identical to "
                "their target "
                "(an identity edit: the LoRA learns to change nothing there), e.g. "
                f"{', '.join(self.identity_examples)}; check the control column/folder")

    def __str__(self) -> str:
        if self.up_to_date and self.unreadable:
            return self._still_unreadable()
        if self.up_to_date:
            return self._nothing_to_do()
        return "\n".join(self._written_lines())

    def _still_unreadable(self) -> str:
        """Up to date but for the files a read error kept out, read again and failing again."""
        n, files = self.quarantined["read-error"], self.unreadable
        named = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        return (f"images v{self.version} kept, no new version: the files a read error kept out of it were read "
                f"again and fail again, nothing else changed: {n} sample(s) in {len(files)} file(s) still "
                f"unreadable ({named}; rows with reason read-error in {self.quarantine_file}): a disk, network "
                "or permission error, not bad data; rerun once they read to add them"
                + (f"; v{self.newer_current}, committed by another writer meanwhile, stays current"
                   if self.newer_current is not None else "")
                + (f"\n{self.sizes}" if self.sizes else ""))

    def _nothing_to_do(self) -> str:
        """Up to date: the version kept, and what else the run noticed."""
        return (f"images v{self.version} is up to date (same source listing and resize settings; no damage "
                f"recorded, its bytes were not re-read: `pipeline store verify {self.store}` checks them); "
                "nothing to do"
                + (f"; v{self.newer_current}, committed by another writer meanwhile, stays current"
                   if self.newer_current is not None else "")
                + (f"\nsource: images v{self.version} was read from {self.source_before}, the same files and "
                   f"bytes are now at {self.source}: nothing re-rendered (v{self.version}, complete, is not "
                   f"rewritten: it names {self.source_before})" if self.source_before else "")
                + (f"\n{self._val_sharing_line()}" if self.val_sharing else "")
                + (f"\n{self._identity_line()}" if self.identity_edits else "")
                + "".join(f"\n{n}" for n in self.source_notes)
                + (f"\n{self.sizes}" if self.sizes else ""))

    def _written_lines(self) -> list[str]:
        """A new version: what it holds, what was quarantined or converted, and the sizes."""
        lines = [
            f"images v{self.version}: {count_text(self.written, 'sample')} written"
            + (f", {self.reused} reused (carried forward, not re-rendered)" if self.reused else "")
            + (f", {self.resumed} kept from an interrupted run" if self.resumed else "")
            + f" (train {self.splits['train']}, val {self.splits['val']}), "
            + count_text(len(self.buckets), "target bucket"),
        ]
        if self.source_before:
            lines.append(f"source: v{self.version} was begun from {self.source_before} and resumed from {self.source} "
                         f"(the same files and bytes); its samples committed before now name {self.source}")
        if self.repaired_from is not None:
            lines.append(f"v{self.repaired_from} was recorded as damaged: its damaged samples re-rendered from the "
                         f"source, the rest carried forward, v{self.version} verified (v{self.repaired_from} moved to "
                         f"v{self.repaired_from}.damaged/)")
        lines.append(quarantined_line(self.quarantined, self.quarantine_file))
        if self.quarantined["read-error"]:  # the disk's failure, not the data's: said apart from the quarantine
            lines.append(f"could not read {self.quarantined['read-error']} sample(s) (reason read-error: a disk, "
                         "network or permission error, not bad data); this version does not count their files as "
                         "read: rerun once they read again to add them (the rest is carried, not re-rendered)")
        shown = self.duplicates[:5]  # every pair is in the quarantine file; the summary names the first few
        for kept, dropped in shown:
            lines.append(f"duplicate: kept {kept}, dropped {dropped} (same target, controls and caption)")
        if self.duplicate_pairs > len(shown):
            lines.append(f"duplicate: {self.duplicate_pairs - len(shown)} more pairs (reason 'duplicate' in {self.quarantine_file}; "
                         "the detail names the kept file)")
        # a control file missing from an edit pair makes a 0-control sample, a control folder left behind makes
        # every sample one: shown, not silent
        if self.controls:
            lines.append("controls per sample: " + ", ".join(f"{n}: {c}" for n, c in sorted(self.controls.items()))
                         + ("; samples without a control train text-to-image (resize.min_controls: 1 quarantines "
                            "them)" if 0 in self.controls else ""))
        if self.identity_edits:
            lines.append(self._identity_line())
        if self.val_sharing:
            lines.append(self._val_sharing_line())
        lines += self.source_notes
        if self.conversions:
            lines.append("converted: " + ", ".join(f"{c}x {n}" for n, c in sorted(self.conversions.items())))
        if self.sizes:
            lines.append(self.sizes)
        return lines


def committed_summary(st: Store, summary: ResizeSummary, rc: ResizeConfig, repairing: int | None,
                      started: float) -> ResizeSummary:
    """The summary of the version just committed, its counts the whole version's where samples were carried or
    resumed; a repaired version checked first."""
    if repairing is not None:
        _verify_repaired(st, summary, repairing)
    summary.seconds = time.perf_counter() - started
    if summary.resumed or summary.reused:  # the resumed and carried samples count too: the version, whole
        summary.splits, summary.controls, summary.buckets = version_counts(st, summary.version)
    rows = _split_and_images(st, summary.version)
    summary.val_sharing = val_sharing(rows)
    summary.identity_edits, summary.identity_examples = identity_edits(st, summary.version, rows)
    summary.split_by = rc.split_by
    return summary


def up_to_date_summary(st: Store, found: int, newer: Any, rc: ResizeConfig, source: str | Path, notes: list[str],
                       started: float) -> ResizeSummary:
    """The summary of a rerun whose version `found` holds this run's samples: every one reused as it is (counted
    so, as the encoders count theirs)."""
    from store.arrow_columns import value_counts

    before = recorded_source(st, found)
    rows = _split_and_images(st, found)
    splits = value_counts(rows.column("split"))
    same, examples = identity_edits(st, found, rows)
    return ResizeSummary(version=found, up_to_date=True, reused=splits.total(), splits=splits,
                         val_sharing=val_sharing(rows), identity_edits=same, identity_examples=examples,
                         split_by=rc.split_by, seconds=time.perf_counter() - started,
                         sizes=sizes_in_force(rc.model_dump()), store=str(st.root), newer_current=newer,
                         source=str(source), source_before=before if before not in ("", str(source)) else "",
                         source_notes=notes)


def version_counts(st: Store, version: int) -> tuple[Counter, Counter, Counter]:
    """Samples of an `images` version by split, by number of controls and by target bucket (h, w): three columns
    of its checked manifest, counted in Arrow. A reader's whole manifest (every column: ~730 MB at 1M samples) and
    a Python object per row and column took seconds and GBs at the end of a rerun that carried samples forward
    (bench/resize_counts.py)."""
    from store.arrow_columns import value_counts, size_counts
    from store.manifest_files import checked_manifest

    m = checked_manifest(st.version_dir(TABLE, version), ["split", "num_controls", "bucket"])
    return value_counts(m.column("split")), value_counts(m.column("num_controls")), \
        Counter(size_counts(m.column("bucket"), 2))


def split_counts(st: Store, version: int) -> Counter:
    """Samples of an `images` version by split (a kept version's summary), from that one column."""
    from store.arrow_columns import value_counts
    from store.manifest_files import checked_manifest

    return value_counts(checked_manifest(st.version_dir(TABLE, version), ["split"]).column("split"))


def _split_and_images(st: Store, version: int) -> Any:
    from store.manifest_files import checked_manifest

    return checked_manifest(st.version_dir(TABLE, version), ["split", "source_hashes"])


def val_sharing(manifest: Any) -> int:
    """How many val rows have the target and controls (`source_hashes`) of a train row
    (`features.same_pictures`). Split by key (which holds the caption: split_rule.py), a pair listed under several
    captions lands in both splits, and the held-out loss then scores pictures the LoRA was trained on, unsaid."""
    import pyarrow.compute as pc

    from features.same_pictures import sharing_pictures

    split = manifest.column("split")
    val, train = manifest.filter(pc.equal(split, "val")), manifest.filter(pc.equal(split, "train"))
    if not val.num_rows or not train.num_rows:
        return 0
    return int(pc.sum(sharing_pictures(val, train)).as_py() or 0)


IDENTITY_EXAMPLES = 3


def identity_edits(st: Store, version: int, rows: Any) -> tuple[int, list[str]]:
    """(samples of the committed `version` one of whose controls is their target, the first few of their sources
    by name) from `rows`, its `source_hashes` (`features.same_pictures.control_is_target`: no picture read again).
    Counted from the version committed, carried and resumed rows too, so a rerun or a resumed run says the same;
    the examples are the smallest names, not the first rows (row order follows the order rows were committed).
    The `source` column is read only where there is something to name."""
    import pyarrow.compute as pc

    from features.same_pictures import control_is_target
    from store.manifest_files import checked_manifest

    same = control_is_target(rows)
    n = int(same.sum())
    if not n:
        return 0, []
    sources = checked_manifest(st.version_dir(TABLE, version), ["source"]).column("source").filter(pa.array(same))
    first = pc.take(sources, pc.select_k_unstable(sources, k=IDENTITY_EXAMPLES, sort_keys=[("", "ascending")]))
    return n, sorted(first.to_pylist())


def kept_summary(st: Store, kept: int, summary: ResizeSummary, unreadable: list[str],
                 started: float) -> ResizeSummary:
    """The summary of a rerun that kept version `kept` (still_unreadable.py): up to date, its samples reused, this
    run's quarantine counts (the samples still unread among them)."""
    from store.remote_parts import adopt_version

    newer = adopt_version(st, TABLE, kept)  # current again (a run killed before its store.json switch, say)
    splits = split_counts(st, kept)
    return replace(summary, version=kept, up_to_date=True, written=0, resumed=0, reused=splits.total(),
                   splits=splits, bytes_written=0, seconds=time.perf_counter() - started, store=str(st.root),
                   newer_current=newer, unreadable=unreadable, duplicates=list(summary.duplicates))


def _verify_repaired(st: Store, summary: ResizeSummary, repairing: int) -> None:
    """The version re-rendered from a damaged one must verify before the damaged one is set aside."""
    from store.repair import replace_damaged

    done = replace_damaged(st, TABLE, summary.version, repairing, "re-rendered")
    summary.repaired_from = repairing
    tqdm.write(f"resize-bucket: {done}")
