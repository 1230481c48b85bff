"""Training metrics through accelerate's tracker interface: TensorBoard by default with the scalars of before
plus peak memory and samples/s per log step; an unknown or uninstalled tracker is a one-line error before any
work; `train.profile` writes a torch.profiler Chrome trace that parses as JSON and holds the profiled ops."""

from __future__ import annotations

import json

import pytest

from pipeline.config import load_config
from schemas.errors import UserError
from stages.train.recipe import run
from train_store import make_train_store, mixed_specs

SETS = {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.checkpoint_every": 3,
        "train.max_steps": 3}


def test_tensorboard_scalars_peak_memory_and_profile_trace(tiny_edit_model, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(6))
    out = tmp_path / "run"
    run(load_config(None, {**SETS, "train.profile": 2}), store, tiny_edit_model, out)

    ea = EventAccumulator(str(out / "logs"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/padding_efficiency", "train/samples_per_s",
            "train/peak_memory_gb"} <= tags
    for tag in ("train/peak_memory_gb", "train/samples_per_s"):
        events = ea.Scalars(tag)
        assert [e.step for e in events] == [1, 2, 3] and all(e.value > 0 for e in events)

    trace = out / "profile" / "trace-rank0.json"
    events = json.loads(trace.read_text())["traceEvents"]  # Chrome trace format
    names = {e.get("name", "") for e in events}
    assert {"aten::mm", "aten::copy_"} <= names  # the ops of the profiled steps (forward, backward, update)
    assert any(e.get("name") == "[memory]" for e in events)  # with memory events
    assert not list((out / "profile").glob(".*.tmp"))


@pytest.mark.parametrize("name, message", [("nonsense", "unknown tracker 'nonsense'"),
                                           ("wandb", "wandb is not installed")])
def test_unknown_or_missing_tracker_is_one_error_before_training(tiny_edit_model, tmp_path, name, message):
    if name == "wandb":
        try:
            import wandb  # noqa: F401

            pytest.skip("wandb is installed here")
        except ImportError:
            pass
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(4))
    with pytest.raises(UserError, match=message):
        run(load_config(None, {**SETS, "train.log_with": [name]}), store, tiny_edit_model, tmp_path / "run")
    assert not (tmp_path / "run").exists()
