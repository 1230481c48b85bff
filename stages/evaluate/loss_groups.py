"""What both evaluate entries share about their loss groups (`store.loss_array`: REPORT/losses.zarr of
--all-checkpoints, OUT/lora-losses/losses.zarr of one LoRA): the key a group is recorded under (`group_hash`) and
the line saying which (seed, σ) cells a group kept aside gives a grown or shrunk grid (`cells_line`)."""

from __future__ import annotations

import hashlib
import json

import numpy as np


def group_hash(settings: dict) -> str:
    """The key of a loss group: sha256 over the settings' sorted-key JSON (full length: the group's name holds 12)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def cells_line(known: np.ndarray) -> str:
    """What a grid whose `known` (seed, σ) cells come from a kept group computes."""
    new = int((~known).sum())
    return (f"computing {new} new (seed, σ) cell{'s' if new != 1 else ''} of {known.size}" if new
            else "nothing to compute (every cell recorded there)")

