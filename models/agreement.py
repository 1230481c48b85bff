"""A setting each rank resolves from its own device, decided by all ranks together: the attention backend
(models/attention.py `agree`), the precision `dtype: auto` stands for (models/precision.py `agreed_precision`).

Each rank resolves the setting itself (its GPU, its driver, its packages), then every rank sees every rank's
resolution (one all-gather of JSON text, `models.collective.gather_texts`) and takes the same decision from the
same data: the most preferred choice every rank can run. The choices are ordered so that a rank that can run one
can run every later one (native SDPA wherever packed runs, float32 wherever bf16 does): the least preferred of
the ranks' picks is then that choice. A rank that can run none (an explicit setting its device refuses), or picks
that differ outside that order (a configuration that differs per rank), stop every rank with the same one line.

One DDP model then never runs different numerics on different ranks (silently), nor fails later on one rank
alone; the reason names the ranks that held the choice down, and each rank's own pick is kept for the record.
"""

from __future__ import annotations

import json
from typing import Sequence

from schemas.errors import UserError


def agree_on(world: int, mine: dict, field: str, preference: Sequence[str], key: str,
             noun: str) -> tuple[dict, str, list[dict]]:
    """One decision of all ranks (a collective: every rank calls it, `world` > 1). `mine`: this rank's pick under
    `field`, its `reason`, anything else its record keeps (JSON) - or an `error` when it can run no choice.
    `preference`: the choices, most preferred first (module docstring). Every rank's JSON is gathered whole
    (buffers as long as the longest): a reason or error is never cut, whatever its length.

    Returns (the `mine` of the lowest rank holding the agreed pick, the reason, every rank's `mine` with its
    `rank`), the same on every rank. The same pick everywhere: rank 0's reason, said to hold on all ranks.
    Refused with the same `UserError` on every rank: a rank's error (the lowest failing rank's, naming the failing
    ranks), or different picks outside `preference`."""
    from models.collective import gather_texts

    ranks = [{"rank": i, **json.loads(text)} for i, text in enumerate(gather_texts(world, json.dumps(mine), None))]
    failed = [r for r in ranks if r.get("error")]
    if failed:
        where = "" if len(failed) == world else f" (on rank(s) {few(r['rank'] for r in failed)} of {world})"
        raise UserError(failed[0]["error"] + where)
    picks = [r[field] for r in ranks]
    if len(set(picks)) == 1:
        return ranks[0], f"{ranks[0]['reason']}; the same on all {world} ranks", ranks
    if not set(picks) <= set(preference):
        raise UserError(f"{key}: the ranks resolved different {noun}s ("
                        + ", ".join(f"rank {r['rank']}: {r[field]}" for r in ranks)
                        + "): give every rank the same configuration")
    agreed = max(picks, key=list(preference).index)
    held = [r for r in ranks if r[field] == agreed]
    better = sorted({p for p in picks if p != agreed}, key=list(preference).index)
    why = "; ".join(f"rank {r['rank']}: {r['reason']}" for r in held[:3])
    if len(held) > 3:
        why += f"; and {len(held) - 3} more rank(s)"
    reason = (f"all {world} ranks run {agreed}, the best {noun} every rank can run ({'/'.join(better)} on "
              f"rank(s) {few(r['rank'] for r in ranks if r[field] != agreed)} only): {why}")
    return held[0], reason, ranks


def few(ranks) -> str:
    """Rank numbers for a line: the first 8, then how many more."""
    ranks = list(ranks)
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def differed(ranks: list[dict] | None, field: str) -> bool:
    """Whether the ranks' own picks differed (the agreement changed some rank's choice: worth a line)."""
    return ranks is not None and len({r[field] for r in ranks}) > 1
