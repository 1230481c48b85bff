"""Train never trains on damaged features, never writes a non-finite LoRA, holds its run folder alone, detects a
damaged checkpoint on resume, and turns a full disk into one line with nothing left half-written."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import load_config
from schemas import UserError
from stages.train import guard as train_guard, saving as train_saving, state as train_state
from stages.train.recipe import run
from store import Store
from store.integrity import DamagedData
from damage import flip_bit, key_at, sample_byte
from stages.train.data import open_inputs as open_train_tables
from train_store import make_train_store, mixed_specs

runner = CliRunner()
BASE = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 2e-3, "train.lora.rank": 4,
        "train.sigma.sampling": "uniform"}


def cfg_of(**train_cfg):
    return load_config(None, {**BASE, **{f"train.{k}": v for k, v in train_cfg.items()}})


@pytest.fixture
def damaged_store(tmp_path, tiny_edit_model) -> tuple[Path, str]:
    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(8))
    key = key_at(root, "vae", 3)
    flip_bit(*sample_byte(root, "vae", key, "target"), 6)
    return root, key


def test_cli_train_refuses_a_damaged_sample_in_one_line(damaged_store, tiny_edit_model, tmp_path):
    root, key = damaged_store
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", "train", "--store", str(root), "--model", tiny_edit_model, "--out", str(out),
                              "--max-steps", "8", "--batch-size", "2", "--device", "cpu"])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    line = [ln for ln in res.output.splitlines() if "error:" in ln][0]
    assert key in line and "table 'vae' v1" in line and "pipeline store repair" in line and "shard-r00-" in line
    assert not (out / "lora").exists()


def test_skip_damaged_reports_them_and_threshold_stops(damaged_store, tiny_edit_model, tmp_path):
    root, key = damaged_store
    with pytest.raises(UserError, match="1 of 8 'train' samples .* are damaged, more than max_damaged_fraction"):
        run(cfg_of(max_steps=1, on_damaged="skip", max_damaged_fraction=0.1), root, tiny_edit_model, tmp_path / "a")
    result = run(cfg_of(max_steps=2, on_damaged="skip", max_damaged_fraction=0.2), root, tiny_edit_model,
                 tmp_path / "b")
    assert result.steps == 2
    report = json.loads((tmp_path / "b" / train_guard.DAMAGED_REPORT).read_text())
    assert list(report["samples"]) == [key] and "damaged" in report["samples"][key]


def test_the_skip_pre_pass_is_shared_by_the_ranks_and_threads(damaged_store, tiny_edit_model):
    """on_damaged=skip checks every sample before step 0: each rank only its share (rows rank, rank + world,
    ...), in several threads; the shares' findings together are the whole split's (one rank used to read the
    whole split alone, single-threaded, on every rank)."""
    from store.join import find_damaged

    root, key = damaged_store
    masks = []
    for rank in (0, 1):
        with open_train_tables(root, tiny_edit_model) as tables:
            masks.append(find_damaged(tables, rank, 2, workers=3))
            share = len(range(rank, len(tables), 2))
            # only this rank's share was read: its intact rows count as checked, no other row (the damaged
            # sample's bytes are in `vae`)
            assert tables.text.checks.checked_count == share
            assert tables.vae.checks.checked_count + int(masks[-1].sum()) == share
            assert not masks[-1][1 - rank :: 2].any()
            bad = tables.keys.array.to_pylist().index(key)
    combined = masks[0] | masks[1]
    assert list(map(int, combined.nonzero()[0])) == [bad]


def test_evaluate_refuses_a_damaged_val_sample(tmp_path, tiny_edit_model):
    from stages.train.data import load, open_inputs as open_train_tables

    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4, 4))
    r = Store(root).reader("text")
    val = sorted(k for k, s in zip(r.keys(), r.manifest.column("split").to_pylist()) if s == "val")
    key = val[0]
    flip_bit(*sample_byte(root, "text", key, "prompt_embeds"), 6)
    tables = open_train_tables(root, tiny_edit_model, split="val")  # what evaluate reads
    with pytest.raises(DamagedData, match=f"table 'text' v1 .*sample {key}"):
        [load(tables, k) for k in tables.keys]


@pytest.mark.parametrize("value", [float("inf"), 1e38])
def test_nonfinite_loss_stops_naming_step_and_sample_and_writes_no_lora(tmp_path, tiny_edit_model, value):
    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4), poison={2: value})
    from train_store import key_of

    bad_key = key_of(2)
    out = tmp_path / "run"
    with pytest.raises(train_guard.NonFiniteError, match=rf"optimizer step \d+: non-finite loss of samples .*{bad_key}"):
        run(cfg_of(max_steps=4, checkpoint_every=1), root, tiny_edit_model, out)
    assert not (out / "lora").exists()
    for _, ckpt in train_state.complete_checkpoints(out / "checkpoints"):  # earlier checkpoints: finite
        from models.lora import read_lora

        assert all(torch.isfinite(v).all() for v in read_lora(ckpt / "lora")[0].values())
    result = run(cfg_of(max_steps=4, on_nonfinite="skip_step"), root, tiny_edit_model, tmp_path / "run2")
    assert result.skipped_steps and result.steps == 4
    from models.lora import read_lora

    assert all(torch.isfinite(v).all() for v in read_lora(tmp_path / "run2" / "lora")[0].values())


def test_second_train_into_the_same_out_is_refused_naming_the_holder(tmp_path, tiny_edit_model):
    import os
    import socket

    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    out = tmp_path / "run"
    held = train_guard.lock_run_dir(out)  # another run holds the folder
    try:
        with pytest.raises(UserError, match=rf"run folder .* is being written by pid {os.getpid()} on {socket.gethostname()}"):
            run(cfg_of(max_steps=1), root, tiny_edit_model, out)
    finally:
        held.release()
    assert run(cfg_of(max_steps=1), root, tiny_edit_model, out).steps == 1  # free again


@pytest.mark.parametrize("name", ["optimizer.safetensors", "lora/pytorch_lora_weights.safetensors",
                                  "rng-rank00.safetensors", "scheduler.json", "resume.json"])
def test_damaged_checkpoint_is_named_and_the_previous_offered(tmp_path, tiny_edit_model, name):
    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    out = tmp_path / "run"
    run(cfg_of(max_steps=2, checkpoint_every=1), root, tiny_edit_model, out)
    path = out / "checkpoints" / "step-2" / name
    flip_bit(path, path.stat().st_size // 2, 0)
    with pytest.raises(train_state.CheckpointDamaged, match=rf"step-2: {'resume.json' if name == 'resume.json' else name}"
                       r".*damaged.*previous checkpoint step-1 is intact"):
        run(cfg_of(max_steps=3, checkpoint_every=1), root, tiny_edit_model, out, resume=True)


# ---------------------------------------------------------------------------------------------- full disk


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_during_checkpoint_and_final_lora_is_one_line_and_rerun_completes(tmp_path, tiny_edit_model,
                                                                                    monkeypatch):
    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    out = tmp_path / "run"
    args = ["run", "train", "--store", str(root), "--model", tiny_edit_model, "--out", str(out), "--max-steps", "2",
            "--batch-size", "2", "--device", "cpu"]
    real = train_state.save_optimizer
    real_save_lora = train_saving.save_lora

    def half_then_full(optimizer, folder):
        real(optimizer, folder)
        (folder / "optimizer.safetensors").write_bytes(b"half")
        _enospc()

    monkeypatch.setattr(train_state, "save_optimizer", half_then_full)
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "disk full while writing checkpoint step-2" in res.output and "MB free" in res.output
    assert not list((out / "checkpoints").iterdir())  # the temp checkpoint folder was removed
    monkeypatch.setattr(train_state, "save_optimizer", real)

    from safetensors import SafetensorError

    def lora_full(*_a, **_k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                              "\"No space left on device\" }) (os error 28)")

    monkeypatch.setattr(train_saving, "save_lora", lambda t, d, **_: (Path(d).mkdir(parents=True, exist_ok=True), lora_full()))
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and "disk full while writing checkpoint step-2" in res.output
    def final_lora_full(t, d, **kw):  # checkpoints save fine; the final LoRA hits the full disk
        if Path(d).name == ".lora.tmp":
            Path(d).mkdir(parents=True, exist_ok=True)
            (Path(d) / "pytorch_lora_weights.safetensors").write_bytes(b"half")
            lora_full()
        return real_save_lora(t, d, **kw)

    monkeypatch.setattr(train_saving, "save_lora", final_lora_full)
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and "disk full while writing the final LoRA" in res.output, res.output
    assert not (out / ".lora.tmp").exists() and not (out / "lora").exists()
    assert train_state.latest_checkpoint(out / "checkpoints").name == "step-2"  # the committed checkpoint is kept
    monkeypatch.undo()
    res = runner.invoke(app, args + ["--resume"])
    assert res.exit_code == 0, res.output
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
