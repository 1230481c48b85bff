"""Two nodes x one process (`torchrun --nnodes 2 --node-rank 0|1`, a static rendezvous on 127.0.0.1, gloo) train
the same LoRA as one process with the same global batch - and so as one node x two processes
(tests/stages/test_train_ddp.py). Both "nodes" are on this machine and share the local store and the run folder,
as nodes share a network filesystem. Slow (two fresh interpreters): one test, 3 steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from models.lora import read_lora
from pipeline.config import load_config
from stages.train import state as train_state
from stages.train.recipe import run
from test_train_ddp import TRAIN, _free_port
from train_store import assert_close_lora, make_train_store, mixed_specs

REPO = Path(__file__).resolve().parents[2]


def test_two_nodes_train_the_same_lora_as_one_process(tiny_edit_model, tmp_path):
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(11))  # steps of 4, 4 and a tail of 3 (split 2 + 1)
    cfg_file = tmp_path / "train.yaml"
    cfg_file.write_text(yaml.safe_dump({"train": TRAIN}))
    one = run(load_config(cfg_file, {"train.batch_size": 4, "train.device": "cpu"}), store, tiny_edit_model, tmp_path / "one")

    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "pipeline.cli", "run", "train", "--store", str(store), "--model", tiny_edit_model,
         "--out", str(tmp_path / "two"), "--config", str(cfg_file), "--batch-size", "2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outs = [p.communicate(timeout=300) for p in nodes]
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-3000:]
    # One 2-rank run: the summary and the CPU note come from global rank 0 (node 0) only.
    assert [sum(line.startswith("trained ") for line in out.splitlines()) for out, _ in outs] == [1, 0]
    assert sum((out + err).count("processes train on the CPU (gloo)") for out, err in outs) == 1

    ckpt = tmp_path / "two" / "checkpoints" / "step-3"
    assert {p.name for p in ckpt.glob("rng-rank*")} == {"rng-rank00.safetensors", "rng-rank01.safetensors"}
    assert train_state.ResumeRecord.read(ckpt / "resume.json").world_size == 2
    assert_close_lora(read_lora(tmp_path / "one" / "lora")[0], read_lora(tmp_path / "two" / "lora")[0],
                      lr=TRAIN["learning_rate"], steps=3)
