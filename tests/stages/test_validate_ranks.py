"""Validation on every rank: two gloo processes (the CLI's entry point, started warm: tests/stages/two_ranks.py)
each compute half of the val split and sum the per-row losses; the held-out numbers equal one process computing
them all, and both runs write them into RUN/losses.zarr (the layout of evaluate --all-checkpoints) as the
validation steps happen."""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr
import yaml

from models.loading import load_component
from models.lora import add_lora, save_lora
from pipeline.config import load_config
from schemas.config import LoraConfig
from stages.train.recipe import run
from train_store import make_train_store, mixed_specs
from two_ranks import launch_two


def test_two_ranks_validate_halves_and_match_one_process(tiny_edit_model, tmp_path):
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(6, 5, masks=True))
    # a LoRA that changes the outputs, kept (nearly) fixed by a tiny learning rate: the numbers compared are the
    # validation's, not training's (two-process training itself differs by float reassociation)
    t = load_component(tiny_edit_model, "transformer")
    add_lora(t, LoraConfig(rank=4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in t.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    save_lora(t, tmp_path / "init")
    train = {"learning_rate": 1e-12, "lora": {"rank": 4}, "max_steps": 2, "checkpoint_every": 2,
             "validate_every": 1, "validate_max_samples": 5, "validate_noise_seeds": [0, 1],
             "validate_timesteps": [0.3, 0.7], "init_lora": str(tmp_path / "init")}
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump({"train": train}))

    run(load_config(cfg_file, {"train.batch_size": 4, "train.device": "cpu"}), store, tiny_edit_model, tmp_path / "one")
    (rc0, out0, err0), (rc1, out1, err1) = launch_two(
        "rank_cli.py", "run", "train", "--store", str(store), "--model", tiny_edit_model,
        "--out", str(tmp_path / "two"),
        "--config", str(cfg_file), "--batch-size", "2", timeout=600)
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-3000:], err1[-3000:])
    assert (out0 + out1).count("step 2: val loss") == 1  # logged once, by the main process

    one, two = xr.open_zarr(tmp_path / "one" / "losses.zarr"), xr.open_zarr(tmp_path / "two" / "losses.zarr")
    assert list(one.step.values) == list(two.step.values) == [1, 2]
    assert one.loss.dims == ("step", "sample", "seed", "sigma", "region") and one.sizes["sample"] == 5
    assert list(one.sample.values) == list(two.sample.values)
    a, b = one.loss.values, two.loss.values
    assert np.isfinite(a[..., 0]).all() and np.array_equal(np.isnan(a), np.isnan(b))  # every sample, both halves
    np.testing.assert_allclose(b, a, rtol=1e-5, equal_nan=True)
    np.testing.assert_allclose(two.base_loss.values, one.base_loss.values, rtol=1e-5, equal_nan=True)
    assert abs(float(a[..., 0].mean()) - float(one.base_loss.values[..., 0].mean())) > 1e-4  # the LoRA matters
