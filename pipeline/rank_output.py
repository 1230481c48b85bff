"""What a launched command prints: rank 0's stdout only, for `pipeline run all` and a stage launched on its own
alike. The stages' own lines (`encode-text: float32 on cpu`, train's epoch lines) and their summaries are
printed by every rank: 8 ranks, 8 copies of each. An encode summary already counts every rank's share
(`stages.encode.summary.over_ranks`), so rank 0's says it all."""

from __future__ import annotations

import os
from contextlib import contextmanager, redirect_stdout
from typing import Iterator


def is_rank_0() -> bool:
    """Whether this is rank 0 of a launch (a plain run is)."""
    return os.environ.get("RANK", "0") == "0"


@contextmanager
def stdout_of_rank_0(main: bool) -> Iterator[None]:
    """The other ranks' stdout goes nowhere; their stderr stays, for errors and warnings (a failed rank's
    `error:` line, a traceback)."""
    if main:
        yield
        return
    with open(os.devnull, "w") as nowhere, redirect_stdout(nowhere):
        yield
