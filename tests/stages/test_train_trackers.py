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
    assert not list((out / "profile").glob(".*.tmp*"))


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


def test_a_tracker_failing_mid_run_is_one_line_and_training_goes_on(tiny_edit_model, tmp_path, monkeypatch, capsys):
    """A metrics backend that fails while training (a tracking server gone, a full disk under RUN/logs) used to
    end the run with its traceback at that step; now it is named in one line, dropped, and the run trains the
    same LoRA as one whose tracker never failed."""
    from accelerate.tracking import TensorBoardTracker
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from models.lora import read_lora

    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(6))
    run(load_config(None, SETS), store, tiny_edit_model, tmp_path / "ref")
    real = TensorBoardTracker.log

    def failing(self, values, step=None, **kwargs):
        if step == 2:
            raise OSError(28, "No space left on device")
        return real(self, values, step=step, **kwargs)

    monkeypatch.setattr(TensorBoardTracker, "log", failing)
    capsys.readouterr()
    result = run(load_config(None, SETS), store, tiny_edit_model, tmp_path / "run")
    assert result.steps == 3
    printed = capsys.readouterr()
    lines = [x for x in (printed.out + printed.err).splitlines() if "train.log_with" in x]
    assert len(lines) == 1 and "tensorboard failed at step 2" in lines[0] and "No space left" in lines[0], lines
    ref, got = read_lora(tmp_path / "ref" / "lora")[0], read_lora(tmp_path / "run" / "lora")[0]
    assert ref.keys() == got.keys() and all((ref[k] == got[k]).all() for k in ref)
    ea = EventAccumulator(str(tmp_path / "run" / "logs"))
    ea.Reload()
    assert [e.step for e in ea.Scalars("train/loss")] == [1]  # written before it failed, nothing after


def test_each_step_logs_the_share_it_waited_for_data_and_the_end_says_when_it_is_large(tiny_edit_model, tmp_path):
    """train/data_wait_share: the part of a step spent waiting for this rank's micro-batches (inline reads and
    preparation, or a prefetch queue run dry), so a run at scale shows whether the device starves on data."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stages.train.prefetch import data_wait_line

    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(6))
    out = tmp_path / "run"
    result = run(load_config(None, SETS), store, tiny_edit_model, out)
    ea = EventAccumulator(str(out / "logs"))
    ea.Reload()
    events = ea.Scalars("train/data_wait_share")
    assert [e.step for e in events] == [1, 2, 3] and all(0 < e.value < 1 for e in events)
    assert len(result.step_data_times) == 3
    assert all(0 < d < t for d, t in zip(result.step_data_times, result.step_times))

    assert data_wait_line([0.1, 0.1], [1.0, 1.0], 0) is None
    line = data_wait_line([0.5, 0.3], [1.0, 1.0], 0)
    assert "40%" in line and "train.prefetch 2" in line
    assert "prefetch 2 did not keep up" in data_wait_line([0.5, 0.3], [1.0, 1.0], 2)
