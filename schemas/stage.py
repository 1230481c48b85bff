"""What every stage's `run(...)` returns, as a `Protocol` (no base class): `pipeline run all` is a plain loop
that prints `str(summary)` - the stage's one-line summary - and notes whether the stage found itself up to date."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable


@runtime_checkable
class StageSummary(Protocol):
    stage: str  # the command name: resize-bucket, encode-text, encode-vae, train, evaluate
    up_to_date: bool  # True: nothing was computed, the existing output was reused

    def __str__(self) -> str: ...

    def to_json(self) -> dict[str, Any]: ...  # `summary_record(...)`: what `pipeline run <stage> --json` prints


def summary_record(stage: str, table: str | None = None, version: int | None = None, encoded: int = 0,
                   reused: int = 0, quarantined: int = 0, bytes_written: int = 0, seconds: float = 0.0,
                   up_to_date: bool = False, **extra: Any) -> dict[str, Any]:
    """The one JSON shape of a stage summary: `encoded` = computed in this run, `reused` = carried forward from
    an earlier version (or the whole table when up to date), then stage-specific extras."""
    return {"stage": stage, "table": table, "version": version, "encoded": int(encoded), "reused": int(reused),
            "quarantined": int(quarantined), "bytes_written": int(bytes_written), "seconds": round(float(seconds), 3),
            "up_to_date": bool(up_to_date), **extra}


def absolute(path: str | Path | None) -> str | None:
    """A path as a `--json` record names it: resolved, whatever the cwd or the config's spelling (a relative
    --out gave a relative `report` beside an absolute `best_checkpoint`); None stays None."""
    return None if path is None else str(Path(path).resolve())


def quarantined_line(by_reason: Mapping[str, int], rows_in: str = "") -> str:
    """'quarantined 3: control-count 2, duplicate 1 (rows in FILE)': a stage's quarantined samples counted by
    reason, the one way every stage's summary says them ('quarantined 0' for none)."""
    n = sum(by_reason.values())
    return (f"quarantined {n}" + (": " + ", ".join(f"{r} {c}" for r, c in sorted(by_reason.items())) if n else "")
            + (f" (rows in {rows_in})" if n and rows_in else ""))


def few(keys, most: int = 10) -> str:
    """Sorted keys for a summary line: the first `most`, then an ellipsis."""
    shown = sorted(keys)
    return ", ".join(shown[:most]) + (" …" if len(shown) > most else "")
