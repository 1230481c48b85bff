"""A validation re-run at the resumed step (its sample grid failed after its losses were recorded and logged)
repeats only what left no record: TensorBoard holds each step's `val/loss` once, as a straight run's does.
Before, the whole validation ran again and RUN/logs held step 2's val/loss twice (the resumed writer purges only
the steps after the checkpoint), so TensorBoard's curve doubled back at every such resume."""

from __future__ import annotations

import numpy as np
import xarray as xr
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline.config import load_config
from stages.train.recipe import run
from stages.train.validate import Validator
from store.loss_array import GROUP
from train_store import make_train_store, mixed_specs
from test_validation_after_checkpoint import SETS, run_till_the_grid_fails


def _val_steps(run_dir) -> list[int]:
    events = EventAccumulator(str(run_dir / "logs"))  # every event file of the run, purges applied
    events.Reload()
    return [e.step for e in events.Scalars("val/loss")]


def test_a_validation_rerun_at_the_resumed_step_logs_its_loss_once(tiny_edit_model, tmp_path, monkeypatch):
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(5, 2))
    real, grids = Validator.samples_grid, []
    out = tmp_path / "run"
    run_till_the_grid_fails(store, tiny_edit_model, out, monkeypatch)
    assert _val_steps(out) == [2]  # recorded and logged before the grid failed
    base_before = xr.open_zarr(out / GROUP).base_loss.values
    assert np.isfinite(base_before[..., 0]).all()  # all samples (the mask regions: nan without a mask)

    def counted(self, transformer):
        grids.append(1)
        return real(self, transformer)

    losses = []
    real_loss_grid = Validator.grid

    def grid(self, *a, **k):
        losses.append(1)
        return real_loss_grid(self, *a, **k)

    monkeypatch.setattr(Validator, "samples_grid", counted)
    monkeypatch.setattr(Validator, "grid", grid)
    run(load_config(None, {**SETS, "train.max_steps": 4}), store, tiny_edit_model, out, resume=True)
    assert (out / "samples" / "step-000002.png").is_file() and len(grids) == 2  # step 2's grid redone, then 4's
    assert _val_steps(out) == [2, 4]
    # step 4's LoRA pass only: step 2's recorded losses were not recomputed, nor the base grid the curve holds (a
    # resumed process computed it again, a whole pass over the val samples, and threw it away)
    assert len(losses) == 1
    assert np.array_equal(xr.open_zarr(out / GROUP).base_loss.values, base_before, equal_nan=True)


def test_a_run_killed_before_its_first_checkpoint_restarts_with_one_curve(tiny_edit_model, tmp_path, monkeypatch):
    """Killed after two steps, before its first checkpoint: the rerun starts again at step 0 in the same folder.
    Before, its writer purged nothing at step 0 and TensorBoard's curve held steps 1, 2 twice (doubling back)."""
    from stages.train import recipe

    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(4))
    cfg = load_config(None, {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4,
                             "train.max_steps": 3, "train.checkpoint_every": 100})
    real_log = recipe.log

    def killed_after_step_2(r, stats):
        real_log(r, stats)
        if r.step == 2:
            raise KeyboardInterrupt("killed before the first checkpoint (test)")

    monkeypatch.setattr(recipe, "log", killed_after_step_2)
    try:
        run(cfg, store, tiny_edit_model, out)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    run(cfg, store, tiny_edit_model, out)
    events = EventAccumulator(str(out / "logs"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]


def test_a_fresh_start_over_a_killed_one_begins_its_own_curve(tiny_edit_model, tmp_path, monkeypatch):
    """Killed after validating steps 1 and 2 (of 4), before its first checkpoint; restarted in the same folder (a fresh
    start: no checkpoint) validating every 3 steps in bf16 autocast. The curve holds this start's steps only and
    the base it measured: before, steps 1 and 2 of the killed start stayed in it (`validate_every` enters no hash
    and only steps >= the first validation were dropped), under the base grid measured in float32."""
    from stages.train import recipe

    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(4, 2))
    sets = {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.max_steps": 4,
            "train.checkpoint_every": 100, "train.validate_max_samples": 2, "train.validate_every": 1}
    real_log = recipe.log

    def killed_at_step_3(r, stats):  # after step 2's validation
        if r.step == 3:
            raise KeyboardInterrupt("killed before the first checkpoint (test)")
        real_log(r, stats)

    monkeypatch.setattr(recipe, "log", killed_at_step_3)
    try:
        run(load_config(None, sets), store, tiny_edit_model, out)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    killed = xr.open_zarr(out / GROUP)
    assert list(killed.step.values) == [1, 2]
    killed_base = killed.base_loss.values

    run(load_config(None, {**sets, "train.validate_every": 3, "train.mixed_precision": "bf16"}), store,
        tiny_edit_model, out)
    curve = xr.open_zarr(out / GROUP)
    assert list(curve.step.values) == [3]
    assert not np.array_equal(curve.base_loss.values, killed_base, equal_nan=True)  # measured in bf16 now
