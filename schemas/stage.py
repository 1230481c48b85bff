"""What every stage's `run(...)` returns, as a `Protocol` (no base class): `pipeline run all` is a plain loop
that prints `str(summary)` - the stage's one-line summary - and notes whether the stage found itself up to date."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class StageSummary(Protocol):
    stage: str  # the command name: resize-bucket, encode-text, encode-vae, train, evaluate
    up_to_date: bool  # True: nothing was computed, the existing output was reused

    def __str__(self) -> str: ...
