"""What both evaluate entries share about their loss groups (`store.loss_array`: REPORT/losses.zarr of
--all-checkpoints, OUT/lora-losses/losses.zarr of one LoRA): the key a group is recorded under (`group_hash`) and
the line saying which (seed, σ) cells a group kept aside gives a grown or shrunk grid (`cells_line`); and which
groups kept aside stay (`prune`: the `KEPT_ASIDE` used most recently, each use recorded by `used`); what evaluated
into an --all-checkpoints array (`note_computed_on`)."""

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
    names = {Path(p).name for p in in_use if p is not None}
    groups = [p for p in folder.glob("losses.*.zarr") if p.is_dir()]
    # a donor counts among those kept only when it is one kept aside: the group in place (a donor too) is not one,
    # and counting it kept one fewer
    spared = [p for p in groups if p.name in names]
    aside = sorted((p for p in groups if p.name not in names), key=_mtime, reverse=True)
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


#: --all-checkpoints: the devices and libraries that evaluated into a loss array (attribute, not hashed)
COMPUTED_ON = "computed_on"
UNRECORDED = "not recorded (an earlier release)"


def note_computed_on(losses, machine: dict) -> None:
    """Record on the --all-checkpoints loss array (`losses`, opened for writing) what evaluates into it now
    (`machine`: `base_images.machine`'s device and libraries), and say in one line when rows were computed
    elsewhere. The array is not keyed by them (the single-LoRA grids and the base caches are): a device or library
    changes its numbers by float rounding only, as `evaluate.batch_size` does (docs/architecture.md), and a run's
    curve of hundreds of checkpoints is not evaluated again for it; its rows are then of more than one machine,
    which the line and the record say. An array of an earlier release, which did not record it, is recorded as
    such, silently. New groups created later by this opening (another run's losses set aside) record it too."""
    from tqdm.auto import tqdm

    now = {"device": machine["device"], "libraries": machine["libraries"]}
    losses.notes[COMPUTED_ON] = [now]
    recorded = losses.group.attrs.get(COMPUTED_ON)
    recorded = recorded if isinstance(recorded, list) else None
    if recorded is not None and now in recorded:
        return
    holds = losses.has_base() or losses.group["step"].shape[0] > 0
    if recorded is None:
        losses.note(**{COMPUTED_ON: [UNRECORDED, now] if holds else [now]})
        return
    if holds:
        tqdm.write(f"held-out loss: the losses in {losses.path} were computed on {'; '.join(map(describe, recorded))}"
                   f", this run computes on {describe(now)}: they are kept (another device or library rounds them "
                   "otherwise, within float tolerance, as evaluate.batch_size does); remove it to evaluate every "
                   "checkpoint here")
    losses.note(**{COMPUTED_ON: [*recorded, now]})


def describe(machine) -> str:
    """A recorded machine in words: `cuda ['NVIDIA H200'], torch 2.5.1, diffusers 0.32.0, ...`."""
    if not isinstance(machine, dict):
        return str(machine)
    device = machine.get("device")
    where = f"{device[0]} {device[1]}" if isinstance(device, list) and len(device) == 2 and any(device[1]) else \
        str(device[0] if isinstance(device, list) and device else device)
    libraries = machine.get("libraries") if isinstance(machine.get("libraries"), dict) else {}
    return ", ".join([where, *(f"{k} {v}" for k, v in sorted(libraries.items()))])
