"""`pipeline compare` of validation curves (RUN/losses.zarr): their numbers depend on the precision the run trained
in (and its quantised base, attention backend), which their settings did not record, so compare took a bf16 run's
curve and a float32 run's (or an evaluate report) for one scale. Train now notes how it measured beside the
curve, and compare refuses curves measured otherwise, as it refuses reports of another evaluate.dtype; a curve
and a report measured alike compare, and their numbers for the same checkpoint are the same."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xarray as xr

from pipeline.config import load_config
from schemas.config import EvaluateConfig
from schemas.errors import UserError
from stages.evaluate import checkpoints as ev
from stages.evaluate.compare import write_compare
from stages.train.recipe import run
from store.loss_array import GROUP
from train_store import make_train_store, mixed_specs

SETS = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 5e-2, "train.lora.rank": 4,
        "train.sigma.sampling": "uniform", "train.checkpoint_every": 2, "train.validate_every": 2,
        "train.validate_max_samples": 3, "train.validate_noise_seeds": [0], "train.validate_timesteps": [0.3, 0.7],
        "train.max_steps": 2}


def test_validation_curves_of_another_precision_are_refused_and_a_report_measured_alike_matches(
        tiny_edit_model, tmp_path):
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(4, 3))
    run(load_config(None, SETS), store, tiny_edit_model, tmp_path / "fp32")
    run(load_config(None, {**SETS, "train.mixed_precision": "bf16"}), store, tiny_edit_model, tmp_path / "bf16")

    with pytest.raises(UserError, match=r"measured differently \(precision: float32 vs bfloat16"):
        write_compare([str(tmp_path / "fp32"), str(tmp_path / "bf16")], tmp_path / "cmp")

    # evaluate --all-checkpoints on the same val samples, seeds and σ in float32: the same measurement, compared,
    # and the validation curve's numbers are evaluate's
    report = tmp_path / "report"
    ev.run(EvaluateConfig(noise_seeds=[0], timesteps=[0.3, 0.7], max_loss_samples=3, num_samples=0, device="cpu",
                          batch_size=2), store, tiny_edit_model,
           [(2, tmp_path / "fp32" / "checkpoints" / "step-2" / "lora")], report)
    res = write_compare([str(tmp_path / "fp32"), str(report)], tmp_path / "cmp")
    assert res.runs[0].overall == res.runs[1].overall and res.runs[0].base == res.runs[1].base
    curve, evaluated = xr.open_zarr(tmp_path / "fp32" / GROUP), xr.open_zarr(report / GROUP)
    np.testing.assert_array_equal(curve.loss.values, evaluated.loss.values)
    with pytest.raises(UserError, match="measured differently"):
        write_compare([str(tmp_path / "bf16"), str(report)], tmp_path / "cmp")
    # both unset: each records the backend it resolved (native on the CPU), so they stay one scale
    assert curve.attrs["measured"]["attention_backend"] == "native"
    assert json.loads((report / "metrics.json").read_text())["run"]["config"]["attention_backend"] == "native"
    # a curve noted unset (before train noted the resolved one): its run's RUN/attention.json tells, else refused
    import zarr

    group = zarr.open_group(tmp_path / "fp32" / GROUP, mode="r+", use_consolidated=True)
    group.attrs["measured"] = {**group.attrs["measured"], "attention_backend": None}
    zarr.consolidate_metadata(tmp_path / "fp32" / GROUP)
    write_compare([str(tmp_path / "fp32"), str(report)], tmp_path / "cmp-noted-unset")
    (tmp_path / "fp32" / "attention.json").unlink()
    with pytest.raises(UserError, match="attention_backend: None vs native"):
        write_compare([str(tmp_path / "fp32"), str(report)], tmp_path / "cmp-unknown")


def test_a_float32_runs_curve_under_bf16_autocast_is_evaluates_float32_measurement(tiny_edit_model, tmp_path):
    """Validation runs outside the step's autocast (stages/train/validate.py `untouched`): a float32 base trained
    under `mixed_precision: bf16` has its curve computed in float32, the numbers evaluate's float32 gives. It was
    noted "float32 with bf16 autocast" and compare refused it against that report and a float32 run's curve."""
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(4, 3))
    run(load_config(None, {**SETS, "train.dtype": "float32", "train.mixed_precision": "bf16"}), store,
        tiny_edit_model, tmp_path / "autocast")
    report = tmp_path / "report"
    ev.run(EvaluateConfig(noise_seeds=[0], timesteps=[0.3, 0.7], max_loss_samples=3, num_samples=0, device="cpu",
                          batch_size=2), store, tiny_edit_model,
           [(2, tmp_path / "autocast" / "checkpoints" / "step-2" / "lora")], report)
    curve, evaluated = xr.open_zarr(tmp_path / "autocast" / GROUP), xr.open_zarr(report / GROUP)
    np.testing.assert_array_equal(curve.loss.values, evaluated.loss.values)  # the same measurement
    res = write_compare([str(tmp_path / "autocast"), str(report)], tmp_path / "cmp")
    assert res.runs[0].overall == res.runs[1].overall
    run(load_config(None, {**SETS, "train.dtype": "float32"}), store, tiny_edit_model, tmp_path / "fp32")
    write_compare([str(tmp_path / "autocast"), str(tmp_path / "fp32")], tmp_path / "cmp-runs")
    # a bf16 base's curve (its float32 LoRA) is still no float32 measurement, nor evaluate's bf16 (a bf16 adapter)
    run(load_config(None, {**SETS, "train.mixed_precision": "bf16"}), store, tiny_edit_model, tmp_path / "bf16")
    with pytest.raises(UserError, match=r"measured differently \(precision: bfloat16 base, float32 LoRA vs float32"):
        write_compare([str(tmp_path / "bf16"), str(report)], tmp_path / "cmp-bf16")
