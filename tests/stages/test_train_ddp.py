"""Two-process data parallel on CPU (gloo, `accelerate launch --multi_gpu`) trains the same LoRA as one process
with the same global batch, and resumed on one process (elastic resume) it goes on training the LoRA the
straight run trains. Slow (two fresh interpreters): one launch, 3 steps, then 2 more in this process.

The launched run leaves train.device unset, as the README's command does: on a machine without GPUs that must
still be one 2-rank run (not two independent 1-process runs into the same folder)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from models.lora import read_lora
from pipeline.config import load_config
from stages.train import state as train_state
from stages.train.recipe import run
from train_store import assert_close_lora, make_train_store, mixed_specs

REPO = Path(__file__).resolve().parents[2]
TRAIN = {"learning_rate": 2e-3, "sigma": {"sampling": "dynamic_shift"}, "lora": {"rank": 4},
         "caption_dropout": 0.3, "max_steps": 3, "checkpoint_every": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_the_same_lora_as_one_and_resume_on_one(tiny_edit_model, tmp_path, capsys):
    store = tmp_path / "store"
    # 11 samples at global batch 4: steps of 4, 4 and a tail of 3, which the two ranks split 2 + 1.
    make_train_store(store, tiny_edit_model, mixed_specs(11))
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump({"train": TRAIN}))

    # The straight 1-process run goes on to step 5 (epoch 1); its step-3 checkpoint is the reference at 3 steps.
    one = run(load_config(cfg_file, {"train.batch_size": 4, "train.device": "cpu", "train.max_steps": 5}), store,
              tiny_edit_model, tmp_path / "one")
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        "-m", "pipeline.cli", "run", "train", "--store", str(store), "--model", tiny_edit_model,
        "--out", str(tmp_path / "two"), "--config", str(cfg_file), "--batch-size", "2",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # One run, not two: one summary line, one note that the ranks train on the CPU; 3 steps are one epoch.
    lines = [line for line in proc.stdout.splitlines() if line.startswith("trained ")]
    assert len(lines) == 1, proc.stdout
    assert (proc.stdout + proc.stderr).count("processes train on the CPU (gloo)") == 1, proc.stdout
    mean = float(re.search(r"train loss (\S+) \(mean of 3 steps in epoch 0\)", lines[0]).group(1))
    assert abs(mean - sum(one.losses[:3]) / 3) < 2e-4  # the global mean losses match the 1-process run's

    # Step 3 is the uneven tail: scaling each rank's loss by world_size / samples-in-step keeps the mean exact.
    ckpt = tmp_path / "two" / "checkpoints" / "step-3"
    assert {p.name for p in ckpt.glob("rng-rank*")} == {"rng-rank00.safetensors", "rng-rank01.safetensors"}
    assert train_state.ResumeRecord.read(ckpt / "resume.json").world_size == 2
    assert_close_lora(read_lora(tmp_path / "one" / "checkpoints" / "step-3" / "lora")[0],
                      read_lora(tmp_path / "two" / "lora")[0], lr=TRAIN["learning_rate"], steps=3)

    # Elastic resume 2 -> 1 process (same config: batch 2 per process as planned for 2, so each global step of 4
    # samples now runs on one process): steps 4 and 5 (epoch 1) are the straight run's.
    capsys.readouterr()
    resumed = run(load_config(cfg_file, {"train.batch_size": 2, "train.device": "cpu", "train.max_steps": 5}), store,
                  tiny_edit_model, tmp_path / "two", resume=True)
    assert "world size changed 2 -> 1 processes" in capsys.readouterr().out
    assert resumed.start_step == 3 and resumed.steps == 5
    assert all(abs(a - b) < 2e-4 for a, b in zip(resumed.losses, one.losses[3:]))
    record = train_state.ResumeRecord.read(tmp_path / "two" / "checkpoints" / "step-5" / "resume.json")
    assert (record.world_size, record.canonical) == (1, 2)  # the order stays planned for 2 processes
    assert_close_lora(read_lora(tmp_path / "one" / "lora")[0], read_lora(tmp_path / "two" / "lora")[0],
                      lr=TRAIN["learning_rate"], steps=5)
