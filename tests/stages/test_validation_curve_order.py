"""The validation curve's noise seeds and σ are a set of rows, as evaluate's (`schemas.config.held_out_axes`):
hashed, computed and recorded sorted. Before, the curve hashed them in the configured order, so a resume with
`validate_timesteps` / `validate_noise_seeds` reordered set RUN/losses.zarr aside and began a new curve (its
base computed again); a curve recorded that way is still this run's, read and appended to by value."""

from __future__ import annotations

import hashlib
import json

import numpy as np

from models.sample import TrainSample
from schemas.config import TrainConfig
from store.loss_array import GROUP, Axes, LossGroup, LossStore
from stages.train.val_curve import ValidationCurve

SAMPLES = [TrainSample(k, None, [], None, None, [(1, 2, 2)]) for k in ("a", "b")]
TABLES, VERSIONS = {"val": "content"}, {"val": 1}


def _curve(run, seeds, sigmas, start_step):
    cfg = TrainConfig(validate_noise_seeds=seeds, validate_timesteps=sigmas)
    return ValidationCurve(cfg, run, SAMPLES, TABLES, VERSIONS, "model", start_step=start_step)


def _grid(seeds, sigmas, step):
    """A grid whose every cell says which (sample, seed, σ) it is, in the order given."""
    return np.array([[[[100 * step + 10 * i + seed + sigma] * 3 for sigma in sigmas] for seed in seeds]
                     for i in range(len(SAMPLES))], dtype=np.float64)


def _recorded(run):
    """{step: grid} of the curve, seeds and σ sorted, read by their coordinates."""
    group = LossGroup(run / GROUP, Axes(["a", "b"], [], [0, 1], [0.25, 0.75]))
    steps, _, losses = group.losses()
    return dict(zip(steps, losses)), group.base()


def test_a_resume_with_the_grid_reordered_continues_the_curve(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    first = _curve(run, [1, 0], [0.75, 0.25], 0)
    first.record(2, _grid([0, 1], [0.25, 0.75], 2), _grid([0, 1], [0.25, 0.75], 0))  # computed in the curve's order

    resumed = _curve(run, [0, 1], [0.25, 0.75], 2)
    assert resumed.fingerprint == first.fingerprint
    assert resumed.has_step(2)  # the resumed step's validation is not run again
    np.testing.assert_array_equal(resumed.recorded_base(), _grid([0, 1], [0.25, 0.75], 0))
    resumed.record(4, _grid([0, 1], [0.25, 0.75], 4), None)
    assert sorted(p.name for p in run.iterdir()) == [GROUP]  # nothing set aside
    steps, base = _recorded(run)
    assert list(steps) == [2, 4]
    for step, grid in steps.items():
        np.testing.assert_array_equal(grid, _grid([0, 1], [0.25, 0.75], step))
    np.testing.assert_array_equal(base, _grid([0, 1], [0.25, 0.75], 0))


def test_a_curve_recorded_in_the_configured_order_stays_the_runs(tmp_path):
    """An earlier release's curve: settings hashed with seeds [1, 0] and σ [0.75, 0.25] as configured, its axes in
    that order. Resumed with either order, it is continued (not set aside), its base read by value, and re-recorded
    under today's fingerprint."""
    for order in (([1, 0], [0.75, 0.25]), ([0, 1], [0.25, 0.75])):
        run = tmp_path / str(order)
        run.mkdir()
        seeds, sigmas = [1, 0], [0.75, 0.25]
        today = _curve(run, *order, 2)
        settings = {**today.settings, "validate": {**today.settings["validate"], "noise_seeds": seeds,
                                                   "timesteps": sigmas}}
        old = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
        assert old != today.fingerprint
        store = LossStore(run, old, Axes(["a", "b"], ["32x32"] * 2, seeds, sigmas), settings, VERSIONS)
        store.write_base(_grid(seeds, sigmas, 0))
        store.append(2, "training step 2", "", _grid(seeds, sigmas, 2))

        assert today.has_step(2)
        np.testing.assert_array_equal(today.recorded_base(), _grid([0, 1], [0.25, 0.75], 0))
        today.record(4, _grid([0, 1], [0.25, 0.75], 4), None)
        assert sorted(p.name for p in run.iterdir()) == [GROUP], order
        steps, base = _recorded(run)
        assert list(steps) == [2, 4]
        for step, grid in steps.items():
            np.testing.assert_array_equal(grid, _grid([0, 1], [0.25, 0.75], step))
        np.testing.assert_array_equal(base, _grid([0, 1], [0.25, 0.75], 0))
        assert _curve(run, *order, 4).recorded_fingerprint() == today.fingerprint  # re-recorded


def test_a_training_resumed_with_the_grid_reordered_records_the_straight_runs_curve(tiny_edit_model, tmp_path):
    """End to end: a run validated at seeds [1, 0] x σ [0.75, 0.25], resumed with [0, 1] x [0.25, 0.75], holds one
    curve (nothing set aside) whose every cell, by its coordinates, is the straight run's."""
    import xarray as xr

    from pipeline.config import load_config
    from stages.train.recipe import run as train
    from train_store import make_train_store, mixed_specs

    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(5, 3))
    sets = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 5e-3, "train.lora.rank": 4,
            "train.sigma.sampling": "uniform", "train.checkpoint_every": 2, "train.validate_every": 1,
            "train.validate_max_samples": 2}
    sorted_grid = {"train.validate_noise_seeds": [0, 1], "train.validate_timesteps": [0.25, 0.75]}
    reordered = {"train.validate_noise_seeds": [1, 0], "train.validate_timesteps": [0.75, 0.25]}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(load_config(None, {**sets, **sorted_grid, "train.max_steps": 3}), store, tiny_edit_model, straight)
    train(load_config(None, {**sets, **reordered, "train.max_steps": 2}), store, tiny_edit_model, resumed)
    train(load_config(None, {**sets, **sorted_grid, "train.max_steps": 3}), store, tiny_edit_model, resumed,
          resume=True)
    assert not list(resumed.glob("losses.*.zarr"))  # nothing set aside
    a, b = (xr.open_zarr(p / GROUP).load() for p in (straight, resumed))
    assert list(b.step.values) == [1, 2, 3]
    b = b.sel(seed=a.seed, sigma=a.sigma)
    np.testing.assert_allclose(b.loss.values, a.loss.values, rtol=1e-6)
    np.testing.assert_allclose(b.base_loss.values, a.base_loss.values, rtol=1e-6)
