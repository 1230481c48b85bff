"""`evaluate.noise_seeds` and `evaluate.timesteps` are sets of rows: their order changes no number (a sample's
loss is the mean over its seeds x σ rows; the noise is drawn from (seed, sample key), each σ's row on its own).
Before, [0.3, 0.7] -> [0.7, 0.3] (or [0, 1] -> [1, 0]) was another fingerprint: every checkpoint and the base
evaluated again. Now both are hashed and computed in sorted order, and a loss array recorded in another order (an
earlier release wrote the axes as set) is read and appended to by value."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import xarray as xr
import zarr

from schemas.config import EvaluateConfig
from stages.evaluate import checkpoints as ev
from stages.evaluate.compare import check_same_held_out, read_curves
from store.loss_array import GROUP
from test_evaluate_checkpoints import CFG, _ckpts, respell_report, run_and_store  # noqa: F401 (the module fixture)
from test_evaluate_checkpoints_base_cache import _counting


def _losses(out) -> xr.Dataset:
    return xr.open_zarr(out / GROUP).sortby(["step", "seed", "sigma"]).load()


def test_reordered_noise_seeds_and_sigmas_evaluate_nothing_again(run_and_store, tiny_edit_model, tmp_path,
                                                                 monkeypatch):
    root, out = run_and_store, tmp_path / "report"
    passes = _counting(monkeypatch)
    first = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    assert first.evaluated == 3 and passes.count("held-out loss (base)") == 1
    reordered = EvaluateConfig(**{**CFG, "noise_seeds": [1, 0], "timesteps": [0.7, 0.3]})
    passes.clear()
    again = ev.run(reordered, root / "store", tiny_edit_model, _ckpts(root), out, skip_if_done=True)
    assert again.up_to_date and passes == []
    forced = ev.run(reordered, root / "store", tiny_edit_model, _ckpts(root), out)  # not up to date: the array kept
    assert forced.evaluated == 0 and passes == []
    assert forced.metrics["checkpoints"]["per_step"] == first.metrics["checkpoints"]["per_step"]
    assert forced.metrics["loss"]["per_timestep"] == first.metrics["loss"]["per_timestep"]
    # a fresh computation under the reordered settings gives the reused numbers to the bit
    fresh = ev.run(reordered, root / "store", tiny_edit_model, _ckpts(root), tmp_path / "fresh")
    assert fresh.evaluated == 3
    for name in ("loss", "base_loss"):
        np.testing.assert_array_equal(_losses(out)[name].values, _losses(tmp_path / "fresh")[name].values)
    assert fresh.metrics["checkpoints"]["per_step"] == forced.metrics["checkpoints"]["per_step"]


def _as_an_earlier_release_wrote(out, cfg: EvaluateConfig) -> None:
    """OUT's array with its seed and σ axes in `cfg`'s order and its settings spelled as set, as a release that
    hashed and computed them in the configured order recorded it."""
    g = zarr.open_group(out / GROUP, mode="r+", use_consolidated=True)
    seeds, sigmas = [int(s) for s in g["seed"][:]], [float(s) for s in g["sigma"][:]]
    ps, pt = [seeds.index(s) for s in cfg.noise_seeds], [sigmas.index(float(t)) for t in cfg.timesteps]
    g["seed"][:] = np.asarray(seeds)[ps]
    g["sigma"][:] = np.asarray(sigmas)[pt]
    g["base_loss"][:] = g["base_loss"][:][:, ps][:, :, pt]
    g["loss"][:] = g["loss"][:][:, :, ps][:, :, :, pt]
    settings = dict(g.attrs["settings"])
    respell_report(out, {**settings, "evaluate": {**settings["evaluate"], "noise_seeds": list(cfg.noise_seeds),
                                                  "timesteps": [float(t) for t in cfg.timesteps]}})


def test_an_array_recorded_in_the_configured_order_is_reused_and_appended_to_by_value(run_and_store, tiny_edit_model,
                                                                                      tmp_path, monkeypatch):
    """An array an earlier release wrote under [0.7, 0.3] (its axes in that order), evaluated again under the same
    [0.7, 0.3]: nothing computed again; a new checkpoint's row goes to its σ and seed by value."""
    root, out = run_and_store, tmp_path / "report"
    unsorted = EvaluateConfig(**{**CFG, "noise_seeds": [1, 0], "timesteps": [0.7, 0.3]})
    first = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    _as_an_earlier_release_wrote(out, unsorted)
    assert [float(s) for s in xr.open_zarr(out / GROUP).sigma.values] == [0.7, 0.3]
    passes = _counting(monkeypatch)
    res = ev.run(unsorted, root / "store", tiny_edit_model, _ckpts(root), out)
    assert res.evaluated == 0 and passes == []
    assert res.metrics["checkpoints"]["steps"] == first.metrics["checkpoints"]["steps"]
    for a, b in zip(res.metrics["checkpoints"]["per_step"], first.metrics["checkpoints"]["per_step"]):
        assert a["overall"] == pytest.approx(b["overall"], rel=1e-12)

    # a checkpoint added: evaluated alone, its row in the recorded array where xarray reads each σ and seed
    run = tmp_path / "run" / "checkpoints"
    shutil.copytree(root / "run" / "checkpoints", run)
    shutil.copytree(root / "run" / "checkpoints" / "step-10", run / "step-40")
    more = [(s, run / f"step-{s}" / "lora") for s in (10, 20, 30, 40)]
    res = ev.run(unsorted, root / "store", tiny_edit_model, more, out)
    assert res.evaluated == 1 and passes.count("held-out loss (base)") == 0
    fresh = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, more, tmp_path / "fresh")
    kept, computed = _losses(out), _losses(tmp_path / "fresh")
    for name in ("loss", "base_loss"):
        np.testing.assert_array_equal(kept[name].values, computed[name].values)
    assert json.loads((out / "metrics.json").read_text())["checkpoints"]["steps"] == [10, 20, 30, 40]
    # `pipeline compare` takes the two for one held-out set (it named the σ grids [0.7, 0.3] and [0.3, 0.7] apart)
    curves = [read_curves(out, "kept"), read_curves(tmp_path / "fresh", "fresh")]
    check_same_held_out(curves)
    assert curves[0].overall == pytest.approx(curves[1].overall, rel=1e-6)


def test_a_single_lora_report_is_current_under_reordered_seeds_and_sigmas(run_and_store, tiny_edit_model, tmp_path,
                                                                         monkeypatch):
    """One LoRA's report: the same (its config fingerprint and base losses' key were of the order as set); forced,
    its base losses come from OUT/base-losses.safetensors, in the order they are keyed by."""
    from stages.evaluate import loss_section, stage

    root, out, lora = run_and_store, tmp_path / "report", _ckpts(run_and_store)[0][1]
    first = stage.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, lora, out)
    reordered = EvaluateConfig(**{**CFG, "noise_seeds": [1, 0], "timesteps": [0.7, 0.3]})
    assert stage.run(reordered, root / "store", tiny_edit_model, lora, out, skip_if_done=True).up_to_date
    passes = []
    real = loss_section.loss_grid
    monkeypatch.setattr(loss_section, "loss_grid", lambda *a, **k: (passes.append(k.get("desc")), real(*a, **k))[1])
    forced = stage.run(reordered, root / "store", tiny_edit_model, lora, out)
    assert passes == [], passes  # both grids kept in OUT/lora-losses, by their coordinates
    assert forced.metrics["loss"] == first.metrics["loss"]
    import shutil

    from stages.evaluate.lora_losses import FOLDER

    shutil.rmtree(out / FOLDER)  # as a report made before the grids were kept: the base from its file
    forced = stage.run(reordered, root / "store", tiny_edit_model, lora, out)
    assert passes == ["held-out loss (lora)"], passes
    assert forced.metrics["loss"]["per_timestep"] == first.metrics["loss"]["per_timestep"]
    assert forced.metrics["loss"]["overall"] == first.metrics["loss"]["overall"]


def test_a_group_kept_aside_in_the_configured_order_is_taken_back(run_and_store, tiny_edit_model, tmp_path,
                                                                  monkeypatch, capsys):
    """An earlier release's array of [1, 0] x [0.7, 0.3] (recorded as set), kept aside by another setting (here a
    LoRA scale), then those settings again: the kept group is the one taken back (its steps pruned since too), as
    the array in place would be reused, and the line says so. Before, only a group kept under the sorted spelling's
    hash was taken back: the earlier release's stayed aside and the checkpoints' rows were made again."""
    import os

    root, out = run_and_store, tmp_path / "report"
    unsorted = EvaluateConfig(**{**CFG, "noise_seeds": [1, 0], "timesteps": [0.7, 0.3]})
    first = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    _as_an_earlier_release_wrote(out, unsorted)
    old = os.stat(out / GROUP).st_ino
    ev.run(EvaluateConfig(**{**CFG, "lora_scale": 0.5}), root / "store", tiny_edit_model, _ckpts(root), out)
    assert os.stat(out / GROUP).st_ino != old  # kept aside
    passes = _counting(monkeypatch)
    capsys.readouterr()
    res = ev.run(unsorted, root / "store", tiny_edit_model, _ckpts(root), out, skip_if_done=True)
    said = capsys.readouterr().out
    assert os.stat(out / GROUP).st_ino == old and passes == [] and res.evaluated == 0
    assert "taken back," in said and "writing the report again" in said, said  # `redone` agrees
    for a, b in zip(res.metrics["checkpoints"]["per_step"], first.metrics["checkpoints"]["per_step"]):
        assert a["overall"] == pytest.approx(b["overall"], rel=1e-12)
    # recorded under the sorted spelling now: the next run finds it up to date in place
    again = ev.run(unsorted, root / "store", tiny_edit_model, _ckpts(root), out, skip_if_done=True)
    assert again.up_to_date
