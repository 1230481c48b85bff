"""Elastic resume mid-epoch with gradient accumulation running on into the next epoch, token-budget batches and
EMA (gloo: two ranks through the CLI's entry point, started warm, tests/stages/two_ranks.py): 1 process to step 2,
2 processes to step 5, 1 process to step 6 train the LoRA, the EMA and the loss curve a straight one-process run
trains, within float reassociation. (test_train_ddp.py resumes at epoch boundaries with fixed batches and no
accumulation, and keeps one launch of `accelerate launch` itself: its agent and two cold ranks cost ~25 s of
imports a launch.) 9 samples at a budget of 80 tokens: 6 micro-steps per epoch, 4 per optimizer step, so step 5
(on two processes) runs on into epoch 3 (and may hold a sample twice)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from models.lora import read_lora
from pipeline.config import load_config
from stages.train.recipe import run
from train_store import assert_close_lora, make_train_store, mixed_specs
from two_ranks import launch_two

LR = 2e-3
TRAIN = {"learning_rate": LR, "lora": {"rank": 4}, "caption_dropout": 0.3, "grad_accum": 4,
         "max_tokens_per_batch": 80, "ema_decay": 0.5, "checkpoint_every": 1, "keep_checkpoints": 10,
         "warmup_steps": 2, "max_steps": 6}  # constant after the warm-up: max_steps may change on a resume


def _loss_curve(run_dir: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "logs"))
    ea.Reload()
    return [(e.step, e.value) for e in ea.Scalars("train/loss")]


def test_one_two_one_processes_mid_epoch_with_accumulation_and_token_budget(tiny_edit_model, tmp_path):
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(9))
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump({"train": TRAIN}))

    def config(steps: int):
        return load_config(cfg_file, {"train.device": "cpu", "train.max_steps": steps})

    straight = run(config(6), store, tiny_edit_model, tmp_path / "straight")
    out = tmp_path / "elastic"
    run(config(2), store, tiny_edit_model, out)
    (rc0, out0, err0), (rc1, out1, err1) = launch_two(
        "rank_cli.py", "run", "train", "--store", str(store), "--model", tiny_edit_model, "--out", str(out),
        "--config", str(cfg_file), "--max-steps", "5", "--resume", timeout=400)
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-3000:], err1[-3000:])
    assert (out0 + out1).count("world size changed 1 -> 2 processes") == 1, out0 + out1
    from stages.train import state as train_state

    for step, world in ((2, 1), (5, 2)):  # both stops inside an epoch
        record = train_state.ResumeRecord.read(out / "checkpoints" / f"step-{step}" / "resume.json")
        assert record.batch_in_epoch != 0 and record.world_size == world, (step, record)
    resumed = run(config(6), store, tiny_edit_model, out, resume=True)
    assert resumed.start_step == 5
    for sub in ("lora", "lora_ema"):
        assert_close_lora(read_lora(tmp_path / "straight" / sub)[0], read_lora(out / sub)[0], lr=LR, steps=6)
    a, b = _loss_curve(tmp_path / "straight"), _loss_curve(out)
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 7))
    assert [v for _, v in b] == pytest.approx([v for _, v in a], rel=1e-4)
    assert list(resumed.losses) == pytest.approx(list(straight.losses)[5:], rel=1e-4)
    import torch

    for sub in ("lora", "lora_ema"):  # the figure docs/train.md quotes
        x, y = read_lora(tmp_path / "straight" / sub)[0], read_lora(out / sub)[0]
        print(sub, "max |dLoRA|", max(float((x[k] - y[k]).abs().max()) for k in x),
              "max rel dloss", max(abs(u - v) / abs(u) for (_, u), (_, v) in zip(a, b)))


def test_two_processes_resumed_on_one_mid_epoch_train_the_two_process_runs_lora(tiny_edit_model, tmp_path):
    """The shrinking side: a run planned for 2 processes (token budget, grad_accum 2, EMA) resumed on 1 from its
    mid-epoch step-2 checkpoint, so the one process accumulates each planned step's two shares as micro-batches of
    the planned size (`elastic.chunks`): the LoRA, EMA and loss curve of the straight 2-process run."""
    import shutil

    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(9))
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump({"train": {**TRAIN, "grad_accum": 2}}))
    straight = tmp_path / "straight"
    (rc0, _, err0), (rc1, _, err1) = launch_two(
        "rank_cli.py", "run", "train", "--store", str(store), "--model", tiny_edit_model, "--out", str(straight),
        "--config", str(cfg_file), "--max-steps", "6", timeout=400)
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-3000:], err1[-3000:])
    from stages.train import state as train_state

    # a run killed after its step-2 checkpoint: that checkpoint, the run's config and its logs so far
    out = tmp_path / "shrunk"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step-2", out / "checkpoints" / "step-2")
    shutil.copytree(straight / "logs", out / "logs")
    shutil.copy(straight / "train_config.yaml", out / "train_config.yaml")
    record = train_state.ResumeRecord.read(out / "checkpoints" / "step-2" / "resume.json")
    assert record.batch_in_epoch != 0 and record.canonical == 2
    resumed = run(load_config(cfg_file, {"train.device": "cpu", "train.max_steps": 6}), store, tiny_edit_model, out,
                  resume=True)
    assert resumed.start_step == 2
    for sub in ("lora", "lora_ema"):
        assert_close_lora(read_lora(straight / sub)[0], read_lora(out / sub)[0], lr=LR, steps=6)
    a, b = _loss_curve(straight), _loss_curve(out)
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 7))
    assert [v for _, v in b] == pytest.approx([v for _, v in a], rel=1e-4)
    import torch

    for sub in ("lora", "lora_ema"):  # the figure docs/train.md quotes
        x, y = read_lora(straight / sub)[0], read_lora(out / sub)[0]
        print(sub, "max |dLoRA|", max(float((x[k] - y[k]).abs().max()) for k in x),
              "max rel dloss", max(abs(u - v) / abs(u) for (_, u), (_, v) in zip(a, b)))
