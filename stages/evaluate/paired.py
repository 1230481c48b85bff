"""How sure a held-out difference is: paired over val samples.

The base and every LoRA / checkpoint are measured on the same val samples with the same noise and σ grid, so two
of them are compared sample by sample: the mean of the per-sample differences (equal to the difference of their
overall losses: every sample has the same seeds x σ rows) and its standard error over samples. The samples are
the independent draws; a sample's seeds x σ rows share its image and are averaged first, as the overall loss does.
A difference within about two standard errors is one this held-out set does not tell apart from noise.
"""

from __future__ import annotations

import math

import numpy as np


def per_sample(grid: np.ndarray) -> np.ndarray:
    """[sample] mean over seeds x σ of a `loss_grid` array's region "all"."""
    return grid[..., 0].mean(axis=(1, 2))


def paired(a: np.ndarray, b: np.ndarray) -> dict:
    """a − b per sample: {"difference": mean, "standard_error": s.d. / √n, "n"}; with fewer than 2 samples there
    is no standard error (None: --json stays strict JSON, no NaN)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    n = int(d.size)
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else None
    return {"difference": float(d.mean()) if n else None, "standard_error": se, "n": n}


def signed(p: dict) -> str:
    """"+0.0123 ± 0.0040" for a summary line ("+0.0123" alone without a standard error)."""
    if p["difference"] is None:
        return "n/a"
    return f"{p['difference']:+.4f}" + (f" ± {p['standard_error']:.4f}" if p["standard_error"] is not None else "")


#: "about two standard errors": a difference to the best within it is one this held-out set does not tell from noise
NOISE_SE = 2.0


def vs_best(grids: np.ndarray, losses: list[float], best_i: int) -> list[dict | None]:
    """Per curve point (`grids[i]`, its overall loss `losses[i]`): its loss minus the best's, paired over the val
    samples (`paired`); None for the best itself and for a point whose loss is not finite (no difference to state)."""
    best = per_sample(grids[best_i])
    return [None if i == best_i or not math.isfinite(loss) else paired(per_sample(grids[i]), best)
            for i, loss in enumerate(losses)]


#: Student's t beyond which a difference over 2, 3, 4 samples (1-3 degrees of freedom) is as rare under no
#: difference as one beyond NOISE_SE standard errors over many (P(z < -2) ≈ 2.3%, one side); `beyond` below
_FEW_T = (13.968, 4.527, 3.307)


def beyond(n: int) -> float:
    """How many standard errors a paired difference over `n` samples must reach to be told apart from none: the
    one-sided Student's t quantile at P(z < -NOISE_SE) for n - 1 degrees of freedom (4.53 over 3 samples, 2.09
    over 32, toward 2 for many; a Cornish-Fisher expansion from 4 degrees of freedom, within 0.01 of the exact
    quantile). Two standard errors over 3 confirming samples said "better than the base" of a best no better in
    9% of trials, over 2 in 14%, where two standard errors promise ~2%."""
    df = n - 1
    if df < 1:  # one sample: no standard error, nothing is told apart
        return math.inf
    if df <= len(_FEW_T):
        return _FEW_T[df - 1]
    z = NOISE_SE
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2) + (
        3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)


def within_noise(p: dict | None) -> bool:
    """Is a point's `vs_best` difference, either sign, within `beyond(n)` standard errors (about NOISE_SE over many
    samples, more over few: not told apart from the best)? A deleted checkpoint may be better than the best on
    disk: -0.050 ± 0.001 is told apart. With one val sample (no standard error) nothing can be said: False."""
    return (p is not None and p["standard_error"] is not None
            and abs(p["difference"]) <= beyond(p["n"]) * p["standard_error"])


def within_text(n: int) -> str:
    """The words for `within_noise` over `n` samples: "within 2 s.e." over many, "within 4.5 s.e." over 3."""
    t = beyond(n)
    return f"within {NOISE_SE:g} s.e." if t < 2.1 else f"within {t:.1f} s.e."
