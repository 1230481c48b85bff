"""Held-out losses that are NaN / inf: one bad val sample (a faulty encoder, a diverged LoRA) must not turn every
mean into NaN and exit 0. Like train's `on_nonfinite`: stop naming the samples, or (`evaluate.on_nonfinite: skip`)
leave those samples out of every mean and name them."""

from __future__ import annotations

import math

from schemas.errors import UserError


class NonFiniteLoss(UserError):
    """A val sample's held-out loss is NaN or infinite (evaluate.on_nonfinite=stop)."""


def finite_rows(keys: list[str], per_row: dict[str, list[float]], on_nonfinite: str, store: str = "") -> tuple[list[int], list[str]]:
    """(indices of the rows whose sample has only finite losses, in every variant; the dropped sample keys).
    `keys[i]` is row i's sample key; `per_row[variant][i]` its loss (variants: base, lora)."""
    bad = sorted({keys[i] for losses in per_row.values() for i, v in enumerate(losses) if not math.isfinite(v)})
    if bad and on_nonfinite == "stop":
        shown = ", ".join(bad[:8]) + (f" … ({len(bad)} in all)" if len(bad) > 8 else "")
        which = sorted(name for name, losses in per_row.items() if not all(math.isfinite(v) for v in losses))
        raise NonFiniteLoss(
            f"non-finite held-out loss ({' and '.join(which)}) of val sample(s) {shown}. "
            + ("With the base as well, the sample's stored features are bad (a faulty encoder writes values with a "
               "valid checksum: rerun the encoders for them); " if "base" in which else
               "Only with the LoRA: the LoRA itself diverged (evaluate an earlier checkpoint); ")
            + "or set evaluate.on_nonfinite=skip to leave such samples out of the means")
    dropped = set(bad)
    return [i for i, k in enumerate(keys) if k not in dropped], bad
