"""What an encode run reports (printed, and `summary.json` through `to_json`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas.stage import few, summary_record

DAMAGED_INPUT = "damaged-input"  # quarantine reason of an `images` sample whose bytes fail their checksum


@dataclass
class Summary:
    stage: str
    table: str
    version: int | None = None
    up_to_date: bool = False
    encoded: int = 0
    reused: int = 0  # carried forward from an earlier version with the same feature lineage (not recomputed)
    skipped: int = 0  # already in committed shards (resume) or the whole table when up to date
    quarantined: int = 0
    bytes_written: int = 0
    seconds: float = 0.0  # the whole run, model loading included
    loop_seconds: float = 0.0  # the encode loop: read, preprocess, forward, write
    forward_seconds: float = 0.0  # inside the model forward (bench: the rest of the loop is overhead)
    forwards: int = 0
    forward_items: int = 0  # prompts (text) or images (vae) through the model; / forwards = mean batch
    rank: int = 0
    world_size: int = 1
    store: str = ""
    damaged: dict[str, str] = field(default_factory=dict)  # on_damaged=skip: damaged `images` samples, key -> problem
    repaired_from: int | None = None  # the version recorded as damaged whose damaged samples this run recomputed
    committed_to: str = ""  # the store URL rank 0 committed on directly (ranks on several nodes: no push back)

    def to_json(self) -> dict[str, Any]:
        # up to date: every sample of the table is reused as it is
        return summary_record(self.stage, self.table, self.version, self.encoded,
                              self.skipped if self.up_to_date else self.reused, self.quarantined, self.bytes_written,
                              self.seconds, self.up_to_date, resumed=0 if self.up_to_date else self.skipped,
                              rank=self.rank, world_size=self.world_size, damaged_inputs=sorted(self.damaged),
                              repaired_from=self.repaired_from)

    def __str__(self) -> str:
        where = f" [rank {self.rank}/{self.world_size}]" if self.world_size > 1 else ""
        if self.up_to_date:
            return (f"{self.stage}{where}: table '{self.table}' v{self.version} is up to date "
                    f"({self.skipped} samples; no damage recorded, its bytes were not re-read: "
                    f"`pipeline store verify {self.store}` checks them); nothing written")
        rate = self.encoded / self.loop_seconds if self.loop_seconds > 0 else 0.0
        line = (
            f"{self.stage}{where}: table '{self.table}' v{self.version}: encoded {self.encoded}, "
            f"reused {self.reused}, skipped (already done) {self.skipped}, quarantined {self.quarantined}, "
            f"{self.bytes_written / 1e6:.2f} MB written in {self.seconds:.1f} s (encoding {rate:.1f} samples/s)"
        )
        if self.repaired_from is not None:
            line += (f"; v{self.repaired_from} was recorded as damaged: its damaged samples recomputed, the rest "
                     f"carried forward, v{self.version} verified (v{self.repaired_from} moved to "
                     f"v{self.repaired_from}.damaged/)")
        if self.damaged:
            line += (f"\nskipped {len(self.damaged)} damaged input sample(s) of table 'images' (on_damaged=skip; "
                     f"quarantined as {DAMAGED_INPUT!r}): {few(self.damaged)}")
        return line
