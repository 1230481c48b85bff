"""The loss passes of `evaluate --all-checkpoints`: REPORT/losses.zarr opened for these settings (`open_losses`),
rank 0's plan of what it lacks sent to every rank (`_plan`, `_shared_plan`: the base, the checkpoints not in it,
the (seed, σ) cells a group kept aside gives), then the base's grid once and one `loss_grid` and one append per
checkpoint, the newest first (`append_missing`; each checkpoint's EMA after them: `append_ema`), every rank
computing its share of the val samples (`_grid`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from models.held_out import loss_grid
from schemas.config import EvaluateConfig
from schemas.units import count_text
from stages.evaluate.checkpoint_load import PRUNED, load_checkpoint
from stages.evaluate.loss_fingerprint import known_fingerprint, spelled_as
from stages.evaluate.loss_groups import cells_line, note_computed_on, recorded_on
from stages.evaluate.whose_losses import this_runs, this_runs_kept, training_of
from store.io_errors import writing
from store.loss_array import Axes, CellDonor, LossStore, cell_donor


def open_losses(out: Path, fingerprint: str, settings: dict, earlier: list[dict], axes: Axes,
                versions: dict) -> LossStore:
    """OUT/losses.zarr for these settings (rank 0): an array recorded under an earlier spelling of them is
    continued and recorded again under today's, with the table versions read, in one commit."""
    with _writing_losses(out):
        out.mkdir(parents=True, exist_ok=True)
        recorded = known_fingerprint(out, fingerprint, settings, earlier)
        losses = LossStore(out, recorded, axes, settings, versions, take_back=True,
                           spelled=spelled_as(settings, earlier))
        if losses.group.attrs.get("fingerprint") != fingerprint:  # in place or taken back under an earlier spelling
            losses.refingerprint(fingerprint, settings, versions)
        losses.note_versions(versions)  # `pipeline compare` against arrays named by versions (no-op when just noted)
    return losses


def _writing_losses(out: Path):
    """A full disk / read-only folder while losses.zarr is written: one line naming it and OUT (before: the CLI's
    last resort named no file, `disk full while writing output in .`, the cwd's free space)."""
    return writing("the held-out loss array (losses.zarr) of the report", out)


def append_missing(ranks, losses: LossStore | None, checkpoints: list[tuple[int, Path]], shas: dict[int, str],
                   transformer, samples, mine: list[int], cfg: EvaluateConfig, load=None, attached: bool = False,
                   first: bool = True, base_cache: tuple | None = None,
                   computed_on: list[dict] = (), what: str = "") -> tuple[int, bool, list[int]]:
    """The base's grid (once) and each checkpoint not yet in the array, one append each (rank 0; `losses` is None
    on the others), the newest first: a training beside evaluate prunes the oldest (train.keep_checkpoints), so
    the newest are the ones still there when their turn comes (the array's order is no order: every reader sorts
    by step). Returns (how many checkpoints were evaluated now, whether the adapter is attached to `transformer`,
    the steps pruned before they could be loaded). `base_cache`: (OUT, rank 0's key of the base losses' inputs):
    an array without base losses takes them from there when recorded under the key, and records them there when
    computed (`stages.evaluate.base_losses`). `computed_on`: every rank's machine (`loss_groups.on_every_rank`),
    recorded with the first row computed (`_record_rows`). `what`: the weights named in the bars ("EMA": the
    checkpoints' EMA files, `append_ema`)."""
    seeds, sigmas = cfg.loss_axes
    shared, donor = _shared_plan(ranks, losses, checkpoints, shas, first, base_cache,
                                 (len(samples), len(seeds), len(sigmas), 3))
    _base_row(ranks, losses, transformer, samples, mine, cfg, load, attached, base_cache,
              recorded=shared.recorded, from_donor=shared.base_from_donor, donor=donor, known=shared.known,
              computed_on=computed_on)
    evaluated, pruned = 0, []
    # no bar with nothing to do: tqdm drew "checkpoints: 0ckpt [00:00, ?ckpt/s]" (no total, no percentage)
    for step, path in tqdm(shared.todo, desc=f"checkpoints' {what}" if what else "checkpoints", unit="ckpt",
                           disable=not ranks.main or not shared.todo):
        partial = bool(shared.from_donor[step])
        if partial and shared.known.all():  # a shrunk grid: every cell of its row recorded under these very bytes
            _record_checkpoint(ranks, losses, step, path, shas[step], (), donor, None)
            continue
        changed, attached = load_checkpoint(ranks, transformer, step, path, shas[step], cfg.lora_scale, attached)
        if changed == PRUNED:
            pruned.append(step)
        if changed:
            continue
        grid = _cells(ranks, transformer, samples, mine, seeds, sigmas, cfg.batch_size,
                      f"held-out loss (step {step}{', ' + what if what else ''})", load,
                      ~shared.known if partial else None)
        _record_checkpoint(ranks, losses, step, path, shas[step], computed_on, donor if partial else None, grid)
        evaluated += 1
    return evaluated, attached, pruned


@dataclass
class _Shared:
    """Rank 0's plan for `append_missing`, as every rank receives it (`_shared_plan`)."""

    recorded: bool  # the base's grid is in the array
    todo: list[tuple[int, Path]]  # the checkpoints to evaluate, the newest first
    base_from_donor: bool  # the donor (rank 0's) holds the base
    from_donor: dict[int, int]  # step -> 1 where the donor holds the checkpoint's row under these bytes
    known: np.ndarray  # [seed, σ]: the cells the donor holds


def _shared_plan(ranks, losses: LossStore | None, checkpoints: list[tuple[int, Path]], shas: dict[int, str],
                 first: bool, base_cache: tuple | None, base_shape: tuple) -> tuple[_Shared, CellDonor | None]:
    """Rank 0's `_plan` (what the array holds, and the donor of cells it takes from: rank 0's alone, None on the
    others) sent to every rank as one list of integers, and read back as a `_Shared` on each."""
    from models.collective import together
    from stages.evaluate import base_losses

    n, cells = len(checkpoints), base_shape[1] * base_shape[2]
    # [base recorded, each checkpoint to evaluate; base from a donor, each checkpoint's row in it; its known cells]
    plan, donor = [0] * (2 * n + 2 + cells), None
    with together(ranks.world, "the loss array"):
        if ranks.main:
            with _writing_losses(losses.path.parent):  # may set an earlier array aside (a rename)
                head, donor = _plan(losses, checkpoints, shas, first, lambda: base_cache is not None and (
                    base_losses.read(Path(base_cache[0]) / base_losses.FILE, base_cache[1], base_shape) is not None))
            plan = head + ([int(donor.has_base())] + [int(donor.holds(step, shas[step])) for step, _ in checkpoints]
                           + donor.known.astype(int).reshape(-1).tolist() if donor else [0] * (n + 1 + cells))
    plan = ranks.from_main(plan)
    return _Shared(
        recorded=bool(plan[0]),
        todo=sorted((c for c, flag in zip(checkpoints, plan[1 : n + 1]) if flag), key=lambda c: c[0], reverse=True),
        base_from_donor=bool(plan[n + 1]),
        from_donor=dict(zip((step for step, _ in checkpoints), plan[n + 2 : 2 * n + 2])),
        known=np.array(plan[2 * n + 2:], dtype=bool).reshape(base_shape[1], base_shape[2])), donor


def _plan(losses: LossStore, checkpoints: list[tuple[int, Path]], shas: dict[int, str],
          first: bool, base_kept=lambda: False) -> tuple[list[int], CellDonor | None]:
    """Rank 0's decisions as integers: [base recorded, then per checkpoint whether it is to be evaluated], and
    the group kept aside whose (seed, σ) cells the missing rows take (`store.loss_array.cell_donor`; None: none).
    `first`: the checkpoints listed at the start (later ones: written by the training meanwhile). `base_kept()`:
    is the base in the base-losses file (`_base_row` reads it from there: no donor's cells, nor named in the line)?"""
    # the group the open set aside for other settings: said below, once it is known whether its cells are reused
    opened_aside = f"{losses.aside_reason}: the earlier losses are kept in {losses.kept_aside}; " \
        if losses.kept_aside is not None and losses.taken_back is None and first else None
    if losses.taken_back is not None and losses.kept_aside is None and first:
        tqdm.write(f"the losses of these settings are taken back from {losses.taken_back} (an earlier run stopped "
                   "while it set them back; only checkpoints not in them are evaluated)")
    elif losses.taken_back is not None and first:
        tqdm.write(f"{losses.aside_reason}: the earlier losses are kept in {losses.kept_aside}; those of these "
                   f"settings are taken back from {losses.taken_back} (only checkpoints not in them are evaluated)")
    if losses.unchecked is not None and first:  # an array of an earlier release lacking a chunk of losses
        tqdm.write(losses.unchecked)
    if not this_runs(losses, checkpoints, shas):  # its numbers go aside; this run's kept ones come back
        back = this_runs_kept(losses.path.parent, losses.fingerprint, checkpoints, shas, losses.axes, losses.spelled)
        losses.start_over("the run's checkpoints are not the ones evaluated before", back and back.path)
        tqdm.write(f"{losses.aside_reason}: earlier losses kept in {losses.kept_aside}" +
                   (f"; this run's are taken back from {losses.taken_back} (only checkpoints not in them are "
                    "evaluated)" if back else ""))
    recorded = losses.steps()
    plan = [int(losses.has_base())] + [int(step not in recorded) for step, _ in checkpoints]
    axes = losses.axes
    needed = {step: shas[step] for (step, _), todo in zip(checkpoints, plan[1:]) if todo}  # the rows to compute
    compute_base = not plan[0] and not base_kept()
    donor = cell_donor(losses.path.parent, losses.settings, axes.seeds, axes.sigmas, axes.keys, compute_base,
                       needed) if compute_base or needed else None
    if first and donor is not None:
        n = sum(1 for (step, _), todo in zip(checkpoints, plan[1:]) if todo and donor.holds(step, shas[step]))
        rows = ["the base"] * (compute_base and donor.has_base()) + [f"{n} checkpoint{'s' if n != 1 else ''}"]
        tqdm.write(f"{opened_aside or ''}the (seed, σ) cells both grids hold are taken from {donor.path} "
                   f"({' and '.join(rows)}): {cells_line(donor.known)}")
    elif opened_aside is not None:
        tqdm.write(f"{opened_aside}every checkpoint is evaluated again")
    return plan, donor


def _base_row(ranks, losses: LossStore | None, transformer, samples, mine: list[int], cfg: EvaluateConfig, load,
              attached: bool, base_cache: tuple | None, recorded: bool, from_donor: bool, donor,
              known: np.ndarray, computed_on: list[dict] = ()) -> None:
    """The base's grid in the array (`append_missing`): `recorded` already, else from the base-losses file
    (`base_cache`), else computed with the adapter off - with `from_donor` (every rank: the plan's flag) only the
    cells not `known` to rank 0's `donor`, an old group holding the base - and written; then checked finite
    (rank 0)."""
    from contextlib import nullcontext

    from models.collective import together
    from stages.evaluate import base_losses
    from stages.evaluate.loss_section import finite_samples
    from stages.evaluate.lora_attach import lora_enabled

    seeds, sigmas = cfg.loss_axes
    base, reused = None, False
    if not recorded and base_cache is not None:  # one decision of all ranks, rank 0's file
        reused, base = base_losses.agreed_reuse(ranks, *base_cache, (len(samples), len(seeds), len(sigmas), 3))
    base_partial = not recorded and not reused and from_donor  # the donor's cells, the others computed
    if not recorded and not reused:  # the plain model: a checkpoint's adapter, once loaded, bypassed
        # (the newer checkpoints of another training set the array aside after one was evaluated: that LoRA's
        # losses were recorded as the base, and kept in the base-losses file for later runs)
        with lora_enabled(transformer, False) if attached else nullcontext():
            base = _cells(ranks, transformer, samples, mine, seeds, sigmas, cfg.batch_size, "held-out loss (base)",
                          load, ~known if base_partial else None)
    with together(ranks.world, "the base losses"):
        if ranks.main:
            if recorded:
                base = losses.base()
            else:
                if base_partial:
                    base = donor.base(base)
                with _writing_losses(losses.path.parent):
                    # wholly a donor's: computed by no rank now (the donor's machines recorded). One read from the
                    # base-losses file (`reused`) was computed on this run's machines: the file's key holds the
                    # device and libraries, every rank's where they differ (`base_images.losses_key`)
                    _record_rows(losses, () if base_partial and known.all() else computed_on,
                                 donor if base_partial else None)
                    losses.write_base(base)
                # the file holds whole computations only: a grown grid's recorded cells are float32
                if base_cache is not None and not reused and not base_partial:
                    base_losses.write(Path(base_cache[0]) / base_losses.FILE, base_cache[1], base)
            # A non-finite base loss means bad stored features (evaluate.on_nonfinite=stop names them): stop
            # before the checkpoints are evaluated, not after all of them
            finite_samples(samples, {"base": base}, cfg)


def _record_checkpoint(ranks, losses: LossStore | None, step: int, path: Path, sha: str, computed_on,
                       donor: CellDonor | None, grid: np.ndarray | None) -> None:
    """One checkpoint's row appended (rank 0), every rank together: `grid` as computed, its cells not computed
    taken from `donor` (a partial row; with `grid` None, every cell: nothing computed, the donor's machines)."""
    from models.collective import together

    with together(ranks.world, f"record checkpoint step {step}"):
        if ranks.main:
            if donor is not None:
                grid = donor.step(step, np.full(losses.axes.shape, np.nan) if grid is None else grid)
            with _writing_losses(losses.path.parent):
                _record_rows(losses, computed_on, donor)
                losses.append(step, str(Path(path).resolve()), sha, grid, training_of(path))


def _record_rows(losses: LossStore, computed_on: list[dict], donor=None) -> None:
    """Rank 0, before it writes a row: the machines that computed its cells recorded on the array (`computed_on`,
    none when nothing was computed), and the donor's record where cells are taken from one
    (`loss_groups.note_computed_on`). A rerun that computes nothing records no machine; an array without a
    record (an earlier release's rows, or none yet) is recorded as such first, before this row makes it hold one."""
    if donor is not None:
        note_computed_on(losses, recorded_on(donor.group), say=False)
    note_computed_on(losses, computed_on)  # a commit only where the record changes


def append_ema(ranks, losses: LossStore | None, ema: tuple, checkpoints: list[tuple[int, Path]], transformer,
                samples, mine: list[int], cfg: EvaluateConfig, load, attached: bool, first: bool,
                computed_on: list[dict]) -> bool:
    """The EMA of each checkpoint not yet in the EMA group (`ema_curve`), appended as `append_missing` appends the
    raw LoRAs (one mechanism: plan, cells kept aside, machines recorded), after the raw array's base is copied in
    (rank 0): the same val samples, noise and σ, so the two curves pair sample for sample. Returns `attached`."""
    from models.collective import together
    from models.ema_file import ema_of

    ema_losses, ema_shas = ema
    with together(ranks.world, "the EMA loss array"):
        if ranks.main and not ema_losses.has_base():
            with _writing_losses(ema_losses.path.parent):
                ema_losses.write_base(losses.base())
    todo = [(step, ema_of(path)) for step, path in checkpoints if step in ema_shas]
    _, attached, _ = append_missing(ranks, ema_losses, todo, ema_shas, transformer, samples, mine, cfg, load,
                                    attached, first, None, computed_on, what="EMA")
    return attached


def _cells(ranks, transformer, samples, mine: list[int], seeds: list[int], sigmas: list[float], batch_size: int,
           desc: str, load, cells: np.ndarray | None) -> np.ndarray:
    """`_grid` of the `cells` to compute (None: all); no pass at all when there is none (a shrunk grid)."""
    if cells is not None and not cells.any():
        return np.full((len(samples), len(seeds), len(sigmas), 3), np.nan)
    return _grid(ranks, transformer, samples, mine, seeds, sigmas, batch_size, desc, load, cells)


def _grid(ranks, transformer, samples, mine: list[int], seeds: list[int], sigmas: list[float], batch_size: int,
          desc: str, load=None, cells: np.ndarray | None = None) -> np.ndarray:
    """`loss_grid` of every sample: in one process all of them; under a launcher this rank's share (`mine`: the
    positions it read, `stages.evaluate.val_share`), summed with the others' (a rank failing in its own pass
    stops every rank: `fails_alone`)."""
    if ranks.world == 1:
        return loss_grid(transformer, samples, seeds, sigmas, batch_size, desc, load=load, cells=cells)
    from models.collective import fails_alone

    # One bar, rank 0's, said to be its share: every rank's progress would take a collective per batch, and the
    # ranks' batch counts differ (shares of unequal size), so they could not all reach it
    shown = f"{desc} [rank 0's share: {len(mine)} of {count_text(len(samples), 'sample')}]"
    with fails_alone(ranks.world, desc, "lower evaluate.batch_size"):
        part = loss_grid(transformer, [samples[i] for i in mine], seeds, sigmas, batch_size, shown, show=ranks.main,
                         cells=cells)
    return ranks.full_grid(part, mine, len(samples))
