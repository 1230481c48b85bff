"""Which val samples pick the best checkpoint and which confirm it (`pick_and_confirm`).

Picking the lowest of K noisy held-out losses and then stating that same loss's difference to the base is
optimistic (the winner's curse): with K checkpoints of equal true quality the lowest is the one whose noise
happened to help most, and "better than base by two standard errors" is said far more often than the ~2% that
two standard errors promise. So the val samples are split in two halves by their keys (`split`): the best is
the lowest loss on the selecting half, and every paired difference stated of it (vs the base, vs each other
checkpoint) is over the confirming half, which took no part in the pick: an unbiased difference with a fair
standard error.

The halves depend on the sample keys alone (never on a loss): the same val split gives the same halves in
every report and rerun, and `pipeline compare` picks each run's best by the same rule. Exceptions, recorded in
`how`: one candidate (nothing is picked: every sample confirms) and fewer than 2 x MIN_HALF val samples (no
halves with a standard error each: every sample picks and confirms, and the report says its difference is
optimistic).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from schemas.units import count_text
from stages.evaluate.curves import pick_best
from stages.evaluate.paired import beyond, paired, per_sample, vs_best

#: how the halves are made (`split`); recorded in metrics.json (`checkpoints.selection.rule`): a report of another
#: rule, or of none (`UNRECORDED`: written before it), is summarised again (`report_current`)
RULE = "picked on half the val samples, stated on the other (halves by sha256 of their keys)"
UNRECORDED = "picked and stated on the same val samples"
MIN_HALF = 2  # samples per half: a standard error needs two
#: what tells a difference apart (`verdict`, `paired.within_noise`); recorded (`checkpoints.selection.verdict`): a
#: report of another threshold, or of none (`VERDICT_UNRECORDED`: 2 s.e. at any size), is summarised again
VERDICT = "beyond Student's t of the two-standard-error rarity (one side, ~2.3%) over the confirming samples"
VERDICT_UNRECORDED = "beyond two standard errors at any number of samples"

SPLIT, ONE_CANDIDATE, TOO_FEW = "split", "one candidate", "too few samples"


def split(keys: list[str], candidates: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(selecting mask, confirming mask, how) over `keys`: the samples ordered by the sha256 of their key, even
    positions select and odd ones confirm (halves of equal size within one, any bucket mix by chance alone)."""
    n = len(keys)
    every = np.ones(n, dtype=bool)
    if candidates <= 1:
        return every, every, ONE_CANDIDATE
    if n < 2 * MIN_HALF:
        return every, every, TOO_FEW
    order = sorted(range(n), key=lambda i: hashlib.sha256(keys[i].encode()).hexdigest())
    select = np.zeros(n, dtype=bool)
    select[order[0::2]] = True
    return select, ~select, SPLIT


def pick_and_confirm(keys: list[str], base: np.ndarray, grids: np.ndarray, steps: list[int], losses: list[float],
                     candidates: list[int]) -> dict | None:
    """The best of `candidates` (indexes into `grids` [point, sample, seed, σ, region], `steps`, `losses`: each
    point's overall loss over every sample) and what is stated of it; None when no candidate's loss is finite.

    best = the lowest mean loss over the selecting samples among the candidates whose overall loss is finite
    (ties: the earlier step, then the earlier point: the raw LoRA before its EMA). Returned: best (its index),
    selecting (each point's loss over the selecting samples), vs_base (best - base) and vs_best (each point -
    best; None for the best and a non-finite point) paired over the confirming samples, runner_up (the next
    lowest selecting loss among the candidates, or None), and `record`: metrics.json's `checkpoints.selection`."""
    select, confirm, how = split(keys, len(candidates))
    rows = np.stack([per_sample(g) for g in grids]) if len(grids) else np.zeros((0, len(keys)))
    selecting = [float(r[select].mean()) if math.isfinite(loss) else math.nan for r, loss in zip(rows, losses)]
    pick = pick_best([steps[i] for i in candidates], [selecting[i] for i in candidates])
    if pick is None:
        return None
    best_i = candidates[pick]
    others = [i for i in candidates if i != best_i and math.isfinite(selecting[i])]
    runner_up = min(others, key=lambda i: (selecting[i], steps[i], i)) if others else None
    return {"best": best_i, "selecting": selecting, "runner_up": runner_up,
            "vs_base": paired(rows[best_i][confirm], per_sample(base)[confirm]),
            "vs_best": vs_best(grids[:, confirm], losses, best_i),
            "record": record(keys, select, confirm, how)}


def record(keys: list[str], select: np.ndarray, confirm: np.ndarray, how: str) -> dict:
    """metrics.json's `checkpoints.selection`: the rule, how it applied, and the keys of the samples that picked
    the best (`selected_on`; none when nothing was picked) and of those its paired differences are over
    (`confirmed_on`)."""
    picked = how != ONE_CANDIDATE
    return {"rule": RULE, "verdict": VERDICT, "how": how,
            "selected_on": [k for k, s in zip(keys, select) if s] if picked else [],
            "confirmed_on": [k for k, c in zip(keys, confirm) if c],
            # the confirming samples took part in the pick: the difference to the base is optimistic
            "optimistic": how == TOO_FEW}


def verdict(vs_base: dict | None) -> str | None:
    """What the best's confirmed difference to the base says: "better than the base" / "worse than the base"
    beyond `beyond(n)` standard errors (about two over many samples, more over few), "not told apart from
    the base" within them, None without a standard error."""
    if not vs_base or vs_base.get("standard_error") is None or vs_base.get("difference") is None:
        return None
    d, se, t = vs_base["difference"], vs_base["standard_error"], beyond(vs_base["n"])
    if d < -t * se:
        return "better than the base"
    if d > t * se:
        return "worse than the base"
    return "not told apart from the base"


def _within(vs_base: dict) -> str:
    """' (within about two standard errors)', or over few samples the t it takes: ' (within 4.5 standard
    errors: over 3 samples a difference must reach that)'."""
    t = beyond(vs_base["n"])
    if t < 2.1:
        return " (within about two standard errors)"
    return f" (within {t:.1f} standard errors: over {vs_base['n']} samples a difference must reach that)"


def described(selection: dict | None, vs_base: dict | None) -> str:
    """The words after a best's difference to the base: which samples it is over and what it says, e.g.
    "over 128 val samples that did not pick it: better than the base"; "" for a report without a selection
    record (written before it)."""
    if not selection:
        return ""
    n = len(selection.get("confirmed_on") or [])
    how = selection.get("how")
    over = count_text(n, "val sample")
    if how == SPLIT:
        where = f"over {over} that did not pick it (the other {len(selection.get('selected_on') or [])} did)"
    elif how == ONE_CANDIDATE:
        where = f"over {'all ' if n > 1 else 'the '}{over} (one checkpoint: nothing picked)"
    else:
        where = (f"over the same {over} that picked it: optimistic (fewer than {2 * MIN_HALF} val samples, too "
                 "few to confirm on others)")
    said = verdict(vs_base)
    return where + (f": {said}" + (_within(vs_base) if said.startswith("not") else "")
                    if said else ": no standard error, nothing can be said")
