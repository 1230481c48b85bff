"""What both evaluate entries share about their loss groups (`store.loss_array`: REPORT/losses.zarr of
--all-checkpoints, OUT/lora-losses/losses.zarr of one LoRA): the key a group is recorded under (`group_hash`) and
the line saying which (seed, σ) cells a group kept aside gives a grown or shrunk grid (`cells_line`); and which
groups kept aside stay (`prune`: the `KEPT_ASIDE` used most recently, each use recorded by `used`); what evaluated
into an --all-checkpoints array (`note_computed_on`, every rank's machine `on_every_rank`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from schemas.lineage import settings_digest


def group_hash(settings: dict) -> str:
    """The key of a loss group: sha256 over the settings' sorted-key JSON (full length: the group's name holds 12)."""
    return settings_digest(settings)


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
    except OSError:  # gone, or another user's: older than it should be (this run's `prune` spares it by name)
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


def on_every_rank(world: int, machine: dict) -> list[dict]:
    """The device and libraries of every rank (`machine`: this rank's, `base_images.machine`), each once, in rank
    order, on every rank: the rows of a launched run are computed on each rank's own device. A collective (one
    all-gather): every rank calls it. One process: its own."""
    from models.collective import gather_texts

    mine = json.dumps({"device": machine["device"], "libraries": machine["libraries"]}, sort_keys=True)
    machines: list[dict] = []
    for text in gather_texts(world, mine, size=None):  # whole (~300 bytes; many libraries, long names: more)
        if (m := json.loads(text)) not in machines:
            machines.append(m)
    return machines


def start_computed_on(losses) -> None:
    """Before any row is written (the --all-checkpoints array opened, rank 0): groups this opening creates later
    (another run's losses set aside) record that nothing evaluated into them yet. The group in place is recorded
    with its first row written (`note_computed_on`: no commit of its own, none when no row is written)."""
    losses.notes[COMPUTED_ON] = []


def recorded_on(group) -> list:
    """What a loss group records as having evaluated into it (`UNRECORDED` for rows of an earlier release)."""
    recorded = group.attrs.get(COMPUTED_ON)
    if isinstance(recorded, list):
        return recorded
    return [UNRECORDED] if "base_loss" in group or group["step"].shape[0] > 0 else []


def note_computed_on(losses, machines: list, say: bool = True) -> None:
    """Record on the --all-checkpoints loss array (`losses`, opened for writing) the `machines` whose numbers are
    written into it now (`on_every_rank`: rows this run computed; or a donor group's `recorded_on`: rows whose
    cells are taken from it), called before such a row is written and only then (a rerun that computes nothing
    recorded the machine it ran on); with `say`, says in one line when the rows it holds were computed
    elsewhere. The array is not keyed by them (the single-LoRA grids and the base caches are): a device or
    library changes its numbers by float rounding only, as `evaluate.batch_size` does (docs/architecture.md), and
    a run's curve of hundreds of checkpoints is not evaluated again for it; its rows are then of more than one
    machine, which the line and the record say."""
    from tqdm.auto import tqdm

    recorded = recorded_on(losses.group)
    new = [m for m in machines if m not in recorded]
    # rows of an earlier release alone (no machine known): recorded as such, silently
    if new and say and any(isinstance(m, dict) for m in recorded) and _holds(losses):
        tqdm.write(f"held-out loss: the losses in {losses.path} were computed on {'; '.join(map(describe, recorded))}"
                   f", this run computes on {'; '.join(map(describe, new))}: they are kept (another device or "
                   "library rounds them otherwise, within float tolerance, as evaluate.batch_size does); remove it "
                   "to evaluate every checkpoint here")
    losses.note(**{COMPUTED_ON: [*recorded, *new]})  # a commit only when it changed


def _holds(losses) -> bool:
    return losses.has_base() or losses.group["step"].shape[0] > 0


def describe(machine) -> str:
    """A recorded machine in words: `cuda ['NVIDIA H200'], torch 2.5.1, diffusers 0.32.0, ...`."""
    if not isinstance(machine, dict):
        return str(machine)
    device = machine.get("device")
    where = f"{device[0]} {device[1]}" if isinstance(device, list) and len(device) == 2 and any(device[1]) else \
        str(device[0] if isinstance(device, list) and device else device)
    libraries = machine.get("libraries") if isinstance(machine.get("libraries"), dict) else {}
    return ", ".join([where, *(f"{k} {v}" for k, v in sorted(libraries.items()))])
