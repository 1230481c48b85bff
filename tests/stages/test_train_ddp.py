"""Elastic data parallel on CPU (gloo, `accelerate launch --multi_gpu`): a run started on one process, resumed on
two, then on one again, trains the LoRA a straight one-process run with the same global batch trains. Slow (two
fresh interpreters): one launch of 3 steps, the rest in this process. (A fresh 2-rank run on two "nodes" against
one process: tests/stages/test_remote_multinode.py.)

The launched run leaves train.device unset, as the README's command does: on a machine without GPUs that must
still be one 2-rank run (not two independent 1-process runs into the same folder)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import yaml

from launch_ports import run_retrying_port
from models.lora import read_lora
from pipeline.config import load_config
from stages.train import state as train_state
from stages.train.recipe import run
from train_store import assert_close_lora, make_train_store, mixed_specs

REPO = Path(__file__).resolve().parents[2]
TRAIN = {"learning_rate": 2e-3, "sigma": {"sampling": "dynamic_shift"}, "lora": {"rank": 4},
         "caption_dropout": 0.3, "max_steps": 3, "checkpoint_every": 3}


def _losses(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("trained ")]
    assert len(lines) == 1, stdout  # one run, not two: one summary line
    return lines[0]


def test_one_then_two_then_one_process_train_the_straight_runs_lora(tiny_edit_model, tmp_path, capsys):
    store = tmp_path / "store"
    # 9 samples at a global batch of 4: steps of 4, 4 and 1 per epoch. On two processes the 1-sample step leaves
    # one rank an empty share (a zero-weight stand-in); the other steps split 2 + 2.
    make_train_store(store, tiny_edit_model, mixed_specs(9))
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump({"train": TRAIN}))

    def config(steps: int):
        return load_config(cfg_file, {"train.batch_size": 4, "train.device": "cpu", "train.max_steps": steps})

    straight = run(config(7), store, tiny_edit_model, tmp_path / "straight")
    run(config(3), store, tiny_edit_model, tmp_path / "elastic")  # epoch 0 on one process

    cmd = lambda port: [  # noqa: E731
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(port),
        "-m", "pipeline.cli", "run", "train", "--store", str(store), "--model", tiny_edit_model,
        "--out", str(tmp_path / "elastic"), "--config", str(cfg_file), "--batch-size", "4", "--max-steps", "6",
        "--resume",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = run_retrying_port(cmd, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).count("processes train on the CPU (gloo)") == 1, proc.stdout
    assert proc.stdout.count("world size changed 1 -> 2 processes") == 1, proc.stdout
    # Steps 4-6 are epoch 1: its global mean loss is the straight run's (each rank's loss scaled by world_size /
    # samples in the step keeps the mean exact for the 1 + 0 step too).
    mean = float(re.search(r"train loss (\S+) \(mean of 3 steps in epoch 1\)", _losses(proc.stdout)).group(1))
    assert abs(mean - sum(straight.losses[3:6]) / 3) < 2e-4

    ckpt = tmp_path / "elastic" / "checkpoints" / "step-6"
    assert {p.name for p in ckpt.glob("rng-rank*")} == {"rng-rank00.safetensors", "rng-rank01.safetensors"}
    record = train_state.ResumeRecord.read(ckpt / "resume.json")
    assert (record.world_size, record.canonical) == (2, 1)  # the order stays planned for one process
    assert_close_lora(read_lora(tmp_path / "straight" / "checkpoints" / "step-6" / "lora")[0],
                      read_lora(ckpt / "lora")[0], lr=TRAIN["learning_rate"], steps=6)

    # ... and back on one process for step 7 (epoch 2).
    capsys.readouterr()
    resumed = run(config(7), store, tiny_edit_model, tmp_path / "elastic", resume=True)
    assert "world size changed 2 -> 1 processes" in capsys.readouterr().out
    assert resumed.start_step == 6 and abs(resumed.losses[0] - straight.losses[6]) < 2e-4
    assert_close_lora(read_lora(tmp_path / "straight" / "lora")[0], read_lora(tmp_path / "elastic" / "lora")[0],
                      lr=TRAIN["learning_rate"], steps=7)
