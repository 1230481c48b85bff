"""One up-to-date rule (`schemas.up_to_date`) decides reuse on every path: a table version (resize, the encoders,
through `Store.find_version`), a trained run, an evaluate report and a checkpoint report. On each path a changed
hashed setting recomputes, a changed throughput setting (the device, the batch size) reuses, and with the rule
forced to say "stale" nothing is called up to date (a path with its own comparison would still reuse)."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from schemas import up_to_date
from schemas.config import EvaluateConfig
from train_store import make_train_store, mixed_specs

TRAIN = {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.sigma.sampling": "uniform",
         "train.max_steps": 2, "train.checkpoint_every": 2}
EVAL = dict(noise_seeds=[0], timesteps=[0.5], batch_size=4, num_samples=0, device="cpu")


def test_the_rule_names_what_changed():
    assert up_to_date.stale_inputs({"a": 1, "b": 2}, {"a": 1, "b": 3}) == ["b"]
    assert up_to_date.stale_inputs({"a": 1}, {"a": 1, "c": 0}) == ["c"]
    assert up_to_date.stale_inputs(None, {"a": 1}) == ["a"]
    assert up_to_date.is_current({"a": [1, 2]}, {"a": [1, 2]})


@pytest.fixture(scope="module")
def trained(tiny_edit_model, tmp_path_factory):
    from stages.train.recipe import run

    root = tmp_path_factory.mktemp("uptodate")
    make_train_store(root / "store", tiny_edit_model, mixed_specs(3, 2))
    run(load_config(None, TRAIN), root / "store", tiny_edit_model, root / "run")
    return root


def test_train_reuses_on_a_device_change_and_recomputes_on_a_hashed_one(trained, tiny_edit_model, monkeypatch):
    from stages.train.recipe import up_to_date as train_up_to_date

    def check(**sets):
        return train_up_to_date(load_config(None, {**TRAIN, **sets}), trained / "store", tiny_edit_model,
                                trained / "run")

    assert check()
    assert check(**{"train.device": "cpu:0", "train.log_every": 5})  # throughput: the same LoRA
    assert not check(**{"train.learning_rate": 2e-4})
    assert not check(**{"train.max_steps": 3})
    monkeypatch.setattr(up_to_date, "is_current", lambda recorded, present: False)
    assert not check()


def test_evaluate_report_reuses_on_a_device_change_and_recomputes_on_a_hashed_one(trained, tiny_edit_model,
                                                                                   tmp_path, monkeypatch):
    from stages.evaluate.stage import report_up_to_date, run

    store, lora, out = trained / "store", trained / "run" / "lora", tmp_path / "report"
    run(EvaluateConfig(**EVAL), store, tiny_edit_model, lora, out)
    assert report_up_to_date(EvaluateConfig(**EVAL), store, tiny_edit_model, lora, out)
    assert report_up_to_date(EvaluateConfig(**{**EVAL, "device": "cpu:0", "batch_size": 1}), store,
                             tiny_edit_model, lora, out)
    assert not report_up_to_date(EvaluateConfig(**{**EVAL, "timesteps": [0.3]}), store, tiny_edit_model, lora, out)
    monkeypatch.setattr(up_to_date, "is_current", lambda recorded, present: False)
    assert not report_up_to_date(EvaluateConfig(**EVAL), store, tiny_edit_model, lora, out)


def test_checkpoint_report_keeps_its_array_on_a_device_or_batch_change(trained, tiny_edit_model, tmp_path,
                                                                       monkeypatch):
    """The loss array's fingerprint comes from the declared scheme: evaluate.batch_size and the device are
    throughput (they used to start a new array and recompute every checkpoint)."""
    from stages.evaluate import checkpoints as ev

    store, out = trained / "store", tmp_path / "report"
    ckpts = [(2, trained / "run" / "checkpoints" / "step-2" / "lora")]
    assert ev.run(EvaluateConfig(**EVAL), store, tiny_edit_model, ckpts, out).evaluated == 1
    again = ev.run(EvaluateConfig(**{**EVAL, "device": "cpu:0", "batch_size": 1}), store, tiny_edit_model, ckpts, out,
                   skip_if_done=True)
    assert again.up_to_date
    changed = ev.run(EvaluateConfig(**{**EVAL, "timesteps": [0.3]}), store, tiny_edit_model, ckpts, out,
                     skip_if_done=True)
    assert not changed.up_to_date and changed.evaluated == 1
    monkeypatch.setattr(up_to_date, "is_current", lambda recorded, present: False)
    assert not ev.run(EvaluateConfig(**{**EVAL, "timesteps": [0.3]}), store, tiny_edit_model, ckpts, out,
                      skip_if_done=True).up_to_date


def test_table_versions_go_through_the_rule(trained, monkeypatch):
    """resize and the encoders reuse a table version only through `Store.find_version`, which asks the rule."""
    from store import Store
    from store.manifest_view import read_schema

    st = Store(trained / "store", create=False)
    version = st.tables()["text"]
    lineage = read_schema(st.version_dir("text", version)).lineage
    assert st.find_version("text", lineage) == version
    monkeypatch.setattr(up_to_date, "is_current", lambda recorded, present: False)
    assert st.find_version("text", lineage) is None
