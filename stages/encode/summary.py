"""What an encode run reports (printed, and `summary.json` through `to_json`)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from schemas.stage import few, quarantined_line, summary_record
from schemas.units import count_text, size_text

DAMAGED_INPUT = "damaged-input"  # quarantine reason of an `images` sample whose bytes fail their checksum
# summed over the ranks; the ranks run side by side, so the summed line's times are the slowest rank's (its wall time):
# the rate over ranks is every rank's samples / that time, not rank 0's share / rank 0's time
COUNTS = ("encoded", "reused", "completed", "skipped", "quarantined", "bytes_written", "forwards", "forward_items")
SLOWEST = ("seconds", "loop_seconds", "forward_seconds")
NAMED_PER_RANK = 10  # damaged samples each rank names in the summed summary (the count is every one)
NAMES_BYTES = 4096  # room for those names per rank (JSON, UTF-8) in the integer all-reduce that carries them


@dataclass
class Summary:
    stage: str
    table: str
    version: int | None = None
    up_to_date: bool = False
    encoded: int = 0
    reused: int = 0  # carried forward from an earlier version with the same feature lineage (not recomputed)
    # its stored part carried from a version of settings that store less (encode-text without no_control_embeds),
    # only the missing columns computed now (not in `encoded`)
    completed: int = 0
    skipped: int = 0  # already in committed shards (resume) or the whole table when up to date
    quarantined: int = 0
    quarantined_by_reason: dict[str, int] = field(default_factory=dict)  # reason -> samples (the line lists them)
    quarantine_file: str = ""  # where their rows are
    bytes_written: int = 0
    seconds: float = 0.0  # the whole run, model loading included
    loop_seconds: float = 0.0  # the encode loop: read, preprocess, forward, write
    forward_seconds: float = 0.0  # inside the model forward (bench: the rest of the loop is overhead)
    forwards: int = 0  # model forwards that ran (a batch halved after an out-of-memory: each part)
    forward_items: int = 0  # prompts (text) or images (vae) through the model; / forwards = mean batch
    rank: int = 0
    world_size: int = 1
    store: str = ""
    damaged: dict[str, str] = field(default_factory=dict)  # on_damaged=skip: damaged `images` samples, key -> problem
    repaired_from: int | None = None  # the version recorded as damaged whose damaged samples this run recomputed
    committed_to: str = ""  # the store URL rank 0 committed on directly (ranks on several nodes: no push back)
    # a store URL: the higher version of the table another writer made current meanwhile, which stays current over
    # `version` (complete, not current); None: `version` is current
    newer_current: int | None = None
    summed: bool = False  # the counts are every rank's (`over_ranks`), not this rank's share
    damaged_total: int | None = None  # summed: damaged samples over every rank (`damaged` names the first of each)

    def to_json(self) -> dict[str, Any]:
        # up to date: every sample of the table is reused as it is
        return summary_record(self.stage, self.table, self.version, self.encoded,
                              self.skipped if self.up_to_date else self.reused, self.quarantined, self.bytes_written,
                              self.seconds, self.up_to_date, resumed=0 if self.up_to_date else self.skipped,
                              **({} if self.summed else {"rank": self.rank}), world_size=self.world_size,
                              damaged_inputs=sorted(self.damaged), damaged_input_count=self.damaged_count,
                              repaired_from=self.repaired_from, newer_current=self.newer_current,
                              quarantined_by_reason=dict(self.quarantined_by_reason),
                              **({"completed": self.completed} if self.completed else {}))

    def committed_line(self) -> str:
        """Rank 0's line after a commit on a store URL (`committed_to`): which version is current there now."""
        line = f"committed table '{self.table}' v{self.version} at {self.committed_to}"
        if self.newer_current is not None:
            line += (f"; v{self.newer_current}, committed by another writer meanwhile, stays current (v{self.version}"
                     " is complete, not current)")
        return line

    @property
    def damaged_count(self) -> int:
        return len(self.damaged) if self.damaged_total is None else self.damaged_total

    def __str__(self) -> str:
        # up to date: every rank counted the whole table, so any rank's line is the table's
        summed = self.summed or self.up_to_date
        where = "" if self.world_size <= 1 else (f" [{self.world_size} ranks]" if summed else
                                                  f" [rank {self.rank}/{self.world_size}]")
        if self.up_to_date:
            return (f"{self.stage}{where}: table '{self.table}' v{self.version} is up to date "
                    f"({count_text(self.skipped, 'sample')}; no damage recorded, its bytes were not re-read: "
                    f"`pipeline store verify {self.store}` checks them); nothing written")
        rate = self.encoded / self.loop_seconds if self.loop_seconds > 0 else 0.0
        line = (
            f"{self.stage}{where}: table '{self.table}' v{self.version}: encoded {self.encoded}, "
            f"reused {self.reused}, " + (f"completed {self.completed} (stored part carried, only the missing "
                                         "columns computed), " if self.completed else "") +
            f"skipped (already done) {self.skipped}, quarantined {self.quarantined}, "
            f"{size_text(self.bytes_written)} written in {self.seconds:.1f} s (encoding {rate:.1f} samples/s)"
        )
        if self.quarantined_by_reason:  # by reason, as resize-bucket's summary says them
            line += "\n" + quarantined_line(self.quarantined_by_reason, self.quarantine_file)
        if self.repaired_from is not None:
            # a damaged schema.json / checksums.json carries nothing forward: every sample is encoded again
            rest = "the rest carried forward" if self.reused or self.skipped else \
                "none of its samples carried forward (every sample encoded again)"
            line += (f"; v{self.repaired_from} was recorded as damaged: its damaged samples recomputed, {rest}, "
                     f"v{self.version} verified (v{self.repaired_from} moved to v{self.repaired_from}.damaged/)")
        if self.damaged:
            shown = few(self.damaged)
            if self.damaged_count > len(self.damaged) and not shown.endswith(" …"):
                shown += " …"  # each rank named its first NAMED_PER_RANK
            line += (f"\nskipped {self.damaged_count} damaged input sample(s) of table 'images' (on_damaged=skip; "
                     f"quarantined as {DAMAGED_INPUT!r}): {shown}")
        return line


def over_ranks(summary: Summary, world: int) -> Summary:
    """This rank's summary with every rank's counts added up and the damaged samples every rank met (the first
    NAMED_PER_RANK of each, and their count): the same summary on every rank, which every rank must reach (each
    encodes its share; rank 0 printed its share alone: `encode-text [rank 0/8]: ... encoded 3` of 24). One
    process, or up to date (every rank counted the whole table): as it is.

    Only integers travel (models/collective/): each rank writes its names as JSON bytes into its own slot of a
    zero array, and the sum over ranks is every rank's slot; the times travel as microseconds."""
    from models.collective import all_max, all_sum

    if world <= 1 or summary.up_to_date:
        return summary
    names = sorted(summary.damaged)[:NAMED_PER_RANK]
    reasons = summary.quarantined_by_reason  # a few distinct reasons: they travel whole, beside the names
    while len(data := json.dumps({"damaged": {k: summary.damaged[k] for k in names},
                                  "reasons": reasons}).encode()) > NAMES_BYTES:
        if names:
            names = names[:-1]  # very long keys or problems: fewer names, the count stays whole
        else:
            reasons = {}  # reasons past the room: the line keeps the count alone
    slots = [0] * (world * NAMES_BYTES)
    slots[summary.rank * NAMES_BYTES: summary.rank * NAMES_BYTES + len(data)] = list(data)
    counts = [int(getattr(summary, name)) for name in COUNTS] + [len(summary.damaged)]
    summed = all_sum(world, counts + slots)
    damaged: dict[str, str] = {}
    by_reason: Counter = Counter()
    for r in range(world):
        slot = bytes(summed[len(counts) + r * NAMES_BYTES: len(counts) + (r + 1) * NAMES_BYTES]).rstrip(b"\0")
        sent = json.loads(slot) if slot else {}
        damaged.update(sent.get("damaged", {}))
        by_reason.update(sent.get("reasons", {}))
    slowest = [t / 1e6 for t in all_max(world, [round(getattr(summary, name) * 1e6) for name in SLOWEST])]
    return replace(summary, **dict(zip(COUNTS, summed)), **dict(zip(SLOWEST, slowest)), damaged=damaged,
                   quarantined_by_reason=dict(by_reason), damaged_total=summed[len(COUNTS)], summed=True)
