"""Single-LoRA evaluate's held-out loss grids kept in OUT/lora-losses/losses.zarr (`store.loss_array`: the base and
one row, the LoRA's, float64 as computed), so that a rerun whose seed / σ grid grew or shrank computes only the
(seed, σ) cells no group there holds, the others taken from the group of the earlier grid (`cell_donor`, the
mechanism --all-checkpoints uses); a seed removed computes nothing, and a rerun for the pictures alone
(num_samples, extra prompts) runs no loss pass. The numbers are a fresh run's to the bit: a cell computed alone is
that cell of a whole grid (`models.held_out.loss_grid`), and the kept cells are float64 as computed.

The group's settings are the loss array's (`loss_fingerprint.read_fingerprint`: the tables read, the model, the loss
settings, the evaluation revision) and the LoRA's bytes: a retrained LoRA is another group (the old one kept aside
beside it, for a return to it; the `loss_groups.KEPT_ASIDE` used most recently stay, `loss_groups.prune`), its base
taken from OUT/base-losses.safetensors. A folder of its own: `pipeline
compare` and --all-checkpoints read OUT/losses.zarr, and would take the one LoRA for a checkpoint curve."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from tqdm.auto import tqdm

from store.io_errors import writing
from store.loss_array import Axes, LossStore, cell_donor

FOLDER = "lora-losses"
STEP = 0  # the LoRA's row (no checkpoint step: the LoRA is named by its bytes)


def settings_of(features: dict, lora_sha256: str, machine: dict) -> dict:
    """The group's settings: `features` (`report_inputs.read_inputs`), the LoRA's sha256 and what computed the numbers
    (`base_images.machine`: as the base-losses file's key; without it a report on another GPU, or after a library
    or source update, took the earlier grids as its own)."""
    return {**features, "lora_sha256": lora_sha256, "machine": machine}


WHAT = "the held-out losses (lora-losses) of the report"  # for `writing`'s error line


def grids(folder: Path, settings: dict, lora: str | Path, axes: Axes,
          compute: Callable[[str, np.ndarray | None], np.ndarray], base_cache: tuple | None,
          check_base: Callable[[np.ndarray], None]) -> dict[str, np.ndarray]:
    """{"base": grid, "lora": grid} over `axes`: each recorded in FOLDER's group of `settings`, else the base from
    the base-losses file (`base_cache`: (OUT, key), whole grids only), else computed - `compute(name, cells)`, only
    the cells (a [seed, σ] mask; None: all) no group of the earlier grid holds - and recorded. `check_base` runs
    on the base before the LoRA's pass (a non-finite base loss: bad stored features, stopped there)."""
    from stages.evaluate import base_losses
    from stages.evaluate.loss_groups import prune

    sha = settings["lora_sha256"]  # hashed: a group holds no row of other bytes
    losses = _group(folder, settings, axes)
    need_base, need_lora = not losses.has_base(), losses.steps().get(STEP) != sha
    # the base-losses file first: a base read from it takes no cell of a donor, and the line says so (it named
    # "the base" among the rows taken from a kept group while the base came from the file)
    kept_base = base_losses.read(Path(base_cache[0]) / base_losses.FILE, base_cache[1], axes.shape) \
        if need_base and base_cache else None
    compute_base = need_base and kept_base is None
    donor = _donor(folder, settings, axes, compute_base, need_lora) if compute_base or need_lora else None
    base = _base_grid(losses, need_base, kept_base, donor, compute, axes, base_cache)
    check_base(base)
    on = _lora_grid(losses, need_lora, donor, compute, axes, lora, sha)
    with writing(WHAT, folder):
        # the group set aside is spared by name too: its date (`used`) is not set in a folder another user owns
        prune(folder, in_use=(donor.path if donor is not None else None, losses.kept_aside))
    return {"base": base, "lora": on}


def _group(folder: Path, settings: dict, axes: Axes) -> LossStore:
    """FOLDER's group of `settings`, opened (taken back from aside, or new: the one in place set aside)."""
    from stages.evaluate.loss_groups import group_hash, used

    with writing(WHAT, folder):
        losses = LossStore(folder, group_hash(settings), axes, settings, take_back=True, dtype="float64")
    if losses.kept_aside is not None and losses.aside_reason != "the settings changed":
        # a damaged / unreadable group (or other samples) set aside: said as --all-checkpoints' `_plan` says it (a
        # retrained LoRA's or a changed setting's group goes aside as this module's doc says, silently)
        tqdm.write(f"held-out loss: {losses.aside_reason}: the earlier losses are kept in {losses.kept_aside}")
    if losses.kept_aside is not None:
        used(losses.kept_aside)  # in use until now: the most recent of those kept aside (`prune`)
    return losses


def _donor(folder: Path, settings: dict, axes: Axes, compute_base: bool, need_lora: bool):
    """The group of the earlier grid whose (seed, σ) cells the grids to compute take (`cell_donor`), with a line
    naming it and the rows it gives; None: none."""
    from stages.evaluate.loss_groups import cells_line, used

    sha = settings["lora_sha256"]
    donor = cell_donor(folder, settings, axes.seeds, axes.sigmas, axes.keys, compute_base,
                       {STEP: sha} if need_lora else {})
    if donor is not None:
        rows = ["the base"] * (compute_base and donor.has_base()) \
            + ["the LoRA"] * (need_lora and donor.holds(STEP, sha))
        tqdm.write(f"held-out loss: the (seed, σ) cells both grids hold are taken from {donor.path} "
                   f"({' and '.join(rows)}): {cells_line(donor.known)}")
        used(donor.path)
    return donor


def _computed(compute: Callable[[str, np.ndarray | None], np.ndarray], donor, axes: Axes, name: str,
              from_donor: bool) -> np.ndarray:
    """`compute(name, ...)` of every cell, or (`from_donor`) of those `donor` lacks (none: all NaN, no pass)."""
    cells = ~donor.known if from_donor else None
    return compute(name, cells) if cells is None or cells.any() else np.full(axes.shape, np.nan)


def _base_grid(losses: LossStore, need_base: bool, kept_base: np.ndarray | None, donor,
               compute: Callable[[str, np.ndarray | None], np.ndarray], axes: Axes,
               base_cache: tuple | None) -> np.ndarray:
    """The base's grid: the group's, else the base-losses file's (`kept_base`), else computed (the donor's cells
    taken) and written to the group (and, computed whole, to the base-losses file)."""
    from stages.evaluate import base_losses

    if not need_base:
        return losses.base()
    base = kept_base
    if base is not None:
        tqdm.write(f"base held-out loss: unchanged inputs, reused from {Path(base_cache[0]) / base_losses.FILE}")
    elif donor is not None and donor.has_base():
        base = donor.base(_computed(compute, donor, axes, "base", True))
    else:
        base = _computed(compute, donor, axes, "base", False)
        if base_cache:  # whole computations only, as --all-checkpoints writes it
            base_losses.write(Path(base_cache[0]) / base_losses.FILE, base_cache[1], base)
    with writing(WHAT, losses.path.parent):
        losses.write_base(base)
    return base


def _lora_grid(losses: LossStore, need_lora: bool, donor, compute: Callable[[str, np.ndarray | None], np.ndarray],
               axes: Axes, lora: str | Path, sha: str) -> np.ndarray:
    """The LoRA's grid: the group's, else computed (the donor's cells taken) and appended to the group."""
    if not need_lora:
        return losses.losses()[2][0]
    partial = donor is not None and donor.holds(STEP, sha)
    on = donor.step(STEP, _computed(compute, donor, axes, "lora", True)) if partial \
        else _computed(compute, donor, axes, "lora", False)
    with writing(WHAT, losses.path.parent):
        losses.append(STEP, str(Path(lora).resolve()), sha, on)
    return on
