"""Every setting is honoured on every path that reads it (issue 24.4): train.dtype under bf16 autocast is the
dtype that loads and is recorded; the damage / dropped / open-shard settings act wherever the features open."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from pipeline.config import load_config
from schemas import UserError
from train_store import make_train_store, mixed_specs

BASE = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 5e-3, "train.lora.rank": 4,
        "train.sigma.sampling": "uniform", "train.max_steps": 2, "train.checkpoint_every": 2}


def cfg_of(**train):
    return load_config(None, {**BASE, **{f"train.{k}": v for k, v in train.items()}})


@pytest.fixture(scope="module")
def store_dir(tiny_edit_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("honoured") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(5, 3))
    return root


def _loads(monkeypatch) -> list[tuple[str, torch.dtype]]:
    """(component, dtype) of every model component loaded from now on."""
    import models.loading as loading

    seen, real = [], loading.load_component

    def spy(model, component, *a, dtype=None, **k):
        seen.append((component, dtype))
        return real(model, component, *a, dtype=dtype, **k)

    monkeypatch.setattr(loading, "load_component", spy)
    return seen


def test_train_dtype_float32_under_bf16_autocast_loads_and_records_float32(store_dir, tiny_edit_model, tmp_path,
                                                                          monkeypatch):
    """`train.dtype: float32` + `mixed_precision: bf16`: a float32 base computing under bf16 autocast, and the
    run records exactly that (it loaded a bf16 base while recording float32)."""
    from stages.train.recipe import run

    loads = _loads(monkeypatch)
    mixed = run(cfg_of(dtype="float32", mixed_precision="bf16"), store_dir, tiny_edit_model, tmp_path / "mixed")
    assert loads == [("transformer", torch.float32)]
    recorded = yaml.safe_load((tmp_path / "mixed" / "train_config.yaml").read_text())["train"]
    assert (recorded["dtype"], recorded["mixed_precision"]) == ("float32", "bf16")
    plain = run(cfg_of(dtype="float32"), store_dir, tiny_edit_model, tmp_path / "plain")
    assert mixed.losses != plain.losses  # the autocast is on: the same float32 base computes otherwise
    # auto under bf16 autocast is a bf16 base, recorded as such
    loads.clear()
    run(cfg_of(mixed_precision="bf16"), store_dir, tiny_edit_model, tmp_path / "auto")
    assert loads == [("transformer", torch.bfloat16)]
    assert yaml.safe_load((tmp_path / "auto" / "train_config.yaml").read_text())["train"]["dtype"] == "bfloat16"


def test_a_loaded_dtype_other_than_the_record_is_refused():
    from models.precision import check_loaded_dtype

    base = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)
    base.requires_grad_(False)
    check_loaded_dtype(base, "bfloat16", "train.dtype")
    with pytest.raises(UserError, match=r"train.dtype: 0.weight was loaded as bfloat16 but float32 is recorded"):
        check_loaded_dtype(base, "float32", "train.dtype")
    base[1].float().requires_grad_(True)  # a trainable (float32) parameter is not the base
    base[1].weight.data = base[1].weight.data.float()
    check_loaded_dtype(base, "bfloat16", "train.dtype")


# ---------------------------------------------------------------- reading settings on every path

N_TRAIN, N_VAL = 6, 4


def _store(root: Path, model: str, skip_vae: set[int] = frozenset()) -> Path:
    """A store with one sample per shard (a short shard damages one sample, not the table)."""
    from store.store import Store

    real = Store.writer
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Store, "writer", lambda self, table, schema, **k: real(self, table, schema, shard_size_mb=1e-6))
        make_train_store(root, model, mixed_specs(N_TRAIN, N_VAL), skip_vae=set(skip_vae))
    return root


def _damage(store: Path, index: int) -> None:
    """Cut the vae shard of sample `index` short (a short shard, found when the table opens; the sample's own
    bytes cut too, so the per-sample check of on_damaged=skip finds it as well)."""
    from store import Store
    from train_store import key_of

    r = Store(store, create=False).reader("vae", on_damaged="skip")
    assert len(set(r.manifest.column("shard").to_pylist())) == len(r.keys())
    shard = r.dir / r.manifest.to_pylist()[r.keys().index(key_of(index))]["shard"]
    r.close()
    shard.write_bytes(shard.read_bytes()[:600])  # the tar header and a little more


def _cfg(**sets):
    return load_config(None, {**BASE, **sets})


def test_train_its_validator_and_its_up_to_date_check_read_as_configured(tiny_edit_model, tmp_path):
    """train.on_damaged / max_damaged_fraction / max_dropped_fraction act in the training, in its validator
    and in `run all`'s up-to-date check (which opened with defaults of their own: on_damaged=skip failed there)."""
    from stages.train.recipe import run, up_to_date

    store = _store(tmp_path / "s", tiny_edit_model, skip_vae={1})  # 1 of 6 train samples dropped (17%)
    _damage(store, 0)  # a train sample
    _damage(store, N_TRAIN)  # a val sample: the validator reads it
    skip = {"train.on_damaged": "skip", "train.max_damaged_fraction": 0.3, "train.max_dropped_fraction": 0.2,
            "train.validate_every": 1}
    out = tmp_path / "run"
    with pytest.raises(UserError, match="truncated"):  # stop: the short shard stops the training
        run(_cfg(**{**skip, "train.on_damaged": "stop"}), store, tiny_edit_model, out)
    done = run(_cfg(**skip), store, tiny_edit_model, tmp_path / "skip")
    assert done.steps == 2 and (tmp_path / "skip" / "damaged_samples.jsonl").is_file()
    assert up_to_date(_cfg(**skip), store, tiny_edit_model, tmp_path / "skip")
    # under stop the run that left a sample out is stale (stages/train/current.py damaged_current) before any read;
    # without its list, the check opens the tables under stop, and the short shard stops it
    assert not up_to_date(_cfg(**{**skip, "train.on_damaged": "stop"}), store, tiny_edit_model, tmp_path / "skip")
    listed = (tmp_path / "skip" / "damaged_samples.jsonl").read_bytes()
    (tmp_path / "skip" / "damaged_samples.jsonl").unlink()
    with pytest.raises(UserError, match="truncated"):
        up_to_date(_cfg(**{**skip, "train.on_damaged": "stop"}), store, tiny_edit_model, tmp_path / "skip")
    (tmp_path / "skip" / "damaged_samples.jsonl").write_bytes(listed)
    # the up-to-date check reads no sample (on_damaged=skip has no pass over the split before step 0): the
    # damage limit acts where samples are read, below and in tests/stages/test_train_integrity.py
    assert up_to_date(_cfg(**{**skip, "train.max_damaged_fraction": 0.1}), store, tiny_edit_model, tmp_path / "skip")
    with pytest.raises(UserError, match="train.max_dropped_fraction"):
        up_to_date(_cfg(**{**skip, "train.max_dropped_fraction": 0.1}), store, tiny_edit_model, tmp_path / "skip")
    # the validator: 1 of 4 val samples damaged; its own threshold is train's
    with pytest.raises(UserError, match="max_damaged_fraction"):
        run(_cfg(**{**skip, "train.max_damaged_fraction": 0.2}), store, tiny_edit_model, tmp_path / "strict")


def test_evaluate_reads_with_its_own_settings(tiny_edit_model, tmp_path):
    """evaluate.on_damaged / max_damaged_fraction / max_dropped_fraction act in evaluate (it borrowed
    train.max_dropped_fraction)."""
    from stages.evaluate.stage import run as evaluate
    from stages.train.recipe import run

    store = _store(tmp_path / "s", tiny_edit_model, skip_vae={N_TRAIN + 1})  # 1 of 4 val samples dropped (25%)
    run(_cfg(), store, tiny_edit_model, tmp_path / "run")
    _damage(store, N_TRAIN)
    quick = {"evaluate.num_samples": 0, "evaluate.timesteps": [0.5], "evaluate.noise_seeds": [0],
             "evaluate.on_damaged": "skip", "evaluate.max_damaged_fraction": 0.5,
             "evaluate.max_dropped_fraction": 0.3, "train.max_dropped_fraction": 0.0}

    def ev(out: str, **sets):
        return evaluate(_cfg(**{**quick, **sets}).evaluate, store, tiny_edit_model, tmp_path / "run" / "lora",
                        tmp_path / out)

    result = ev("ok")
    assert result.metrics["run"]["val_samples"] == 2 and len(result.damaged) == 1
    with pytest.raises(UserError, match="truncated"):
        ev("stop", **{"evaluate.on_damaged": "stop"})
    with pytest.raises(UserError, match="max_damaged_fraction"):
        ev("strict", **{"evaluate.max_damaged_fraction": 0.1})
    with pytest.raises(UserError, match="evaluate.max_dropped_fraction"):
        ev("dropped", **{"evaluate.max_dropped_fraction": 0.1})


def test_max_open_shards_bounds_the_open_files_of_every_reading_section(tiny_edit_model, tmp_path):
    """train.max_open_shards / evaluate.max_open_shards: reading every sample keeps at most that many shard
    files open per table (one sample per shard here); the default keeps them all."""
    import os

    from models.loading import model_files
    from stages.train.data import load_at
    from features.open import open_configured

    store = _store(tmp_path / "s", tiny_edit_model)

    def opened_after_reading(section, name: str, split: str) -> int:
        before = len(os.listdir("/proc/self/fd"))
        tables = open_configured(section, name, store, tiny_edit_model, model_files(tiny_edit_model), split)
        for i in range(len(tables)):
            load_at(tables, i)
        grown = len(os.listdir("/proc/self/fd")) - before
        for r in tables.readers.values():
            r.close()
        tables.lease.release()
        return grown

    for name, split, n in (("train", "train", N_TRAIN), ("evaluate", "val", N_VAL)):
        bounded = _cfg(**{f"{name}.max_open_shards": 1})
        assert opened_after_reading(getattr(bounded, name), name, split) <= 2 + 2  # 1 per table + lease/locks
        assert opened_after_reading(getattr(_cfg(), name), name, split) >= 2 * n  # every shard of both tables
