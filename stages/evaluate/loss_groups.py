"""What both evaluate entries share about their loss groups (`store.loss_array`: REPORT/losses.zarr of
--all-checkpoints, OUT/lora-losses/losses.zarr of one LoRA): the key a group is recorded under (`group_hash`) and
the line saying which (seed, σ) cells a group kept aside gives a grown or shrunk grid (`cells_line`); and which
groups kept aside stay (`prune`: the `KEPT_ASIDE` used most recently, each use recorded by `used`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np


def group_hash(settings: dict) -> str:
    """The key of a loss group: sha256 over the settings' sorted-key JSON (full length: the group's name holds 12)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def cells_line(known: np.ndarray) -> str:
    """What a grid whose `known` (seed, σ) cells come from a kept group computes."""
    new = int((~known).sum())
    return (f"computing {new} new (seed, σ) cell{'s' if new != 1 else ''} of {known.size}" if new
            else "nothing to compute (every cell recorded there)")


#: loss groups kept aside per folder (OUT/lora-losses): the most recently used. Each LoRA, setting, device, library
#: or source update sets one aside (~100 KB at 256 val samples x 8 cells); a return to it (A, B, then A again, or a
#: seed added back) finds it while it is among these, an older one is computed again.
KEPT_ASIDE = 8
_PRUNING = ".pruned-"  # a group being removed: out of the `losses.*.zarr` every reader globs, then deleted


def used(group: Path) -> None:
    """Record that a group kept aside was used now (set aside by this run, or its cells taken): its folder's
    modification time, which `prune` orders by (a rename keeps it; appends, the only other writes, are in place)."""
    try:
        os.utime(group)
    except OSError:  # gone or read-only: it is then only older than it should be
        pass


def prune(folder: Path, in_use: tuple[Path | None, ...] = (), keep: int | None = None) -> list[str]:
    """Remove the groups kept aside in `folder` (`losses.*.zarr`) beyond the `keep` most recently used (`used`),
    never the group in place (`losses.zarr`) nor one `in_use` (the cell donor of this run), and say so in one line.
    Each is renamed out of the readers' glob before it is deleted: a kill mid-way leaves every group they see whole,
    and the next prune removes what it left. Returns the names removed."""
    from tqdm.auto import tqdm

    keep = KEPT_ASIDE if keep is None else keep
    for left in folder.glob(f"{_PRUNING}*"):  # a killed prune's
        shutil.rmtree(left, ignore_errors=True)
    spared = {Path(p).name for p in in_use if p is not None}
    aside = [p for p in folder.glob("losses.*.zarr") if p.is_dir() and p.name not in spared]
    aside.sort(key=_mtime, reverse=True)
    gone = aside[max(0, keep - len(spared)):][::-1]  # the least recently used first
    for group in gone:
        trash = group.with_name(_PRUNING + group.name)
        os.rename(group, trash)
        shutil.rmtree(trash, ignore_errors=True)
    if gone:
        names = ", ".join(g.name for g in gone)
        tqdm.write(f"held-out loss: removed {len(gone)} loss group{'s' if len(gone) != 1 else ''} kept aside in "
                   f"{folder} ({names}): the {keep} used most recently are kept")
    return [g.name for g in gone]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0

