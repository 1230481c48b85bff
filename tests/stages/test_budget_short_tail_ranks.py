"""A token-budget epoch whose leftovers hold fewer samples than ranks ends in a step of its own where a rank has an
empty batch (stages/train/budget.py `TAIL_IN_BUDGET`; before, those samples joined a full step's batches and took
them over the budget). The rank with no sample runs a zero-weight stand-in: two gloo processes train through it,
every step's loss the mean over its real samples, and a resume across it trains the straight run's LoRA bit for
bit. 7 samples at a budget of 60 tokens on 2 ranks: steps of [2, 2], [1, 1] and [1, 0] samples each epoch."""

from __future__ import annotations

from pathlib import Path

import torch

from models.lora import read_lora
from stages.train.budget import make_sampler
from train_store import make_train_store, mixed_specs, open_split
from two_ranks import launch_two

BUDGET = 60


def _train(store: Path, model: str, out: Path, steps: int, resume: bool = False) -> str:
    args = ["run", "train", "--store", str(store), "--model", model, "--out", str(out), "--device", "cpu",
            "--max-steps", str(steps), "--set", f"train.max_tokens_per_batch={BUDGET}", "--set",
            "train.checkpoint_every=1", "--set", "train.lora.rank=4", "--set", "train.learning_rate=2e-3"]
    (rc0, out0, err0), (rc1, _, err1) = launch_two("rank_cli.py", *args, *(["--resume"] if resume else []))
    assert rc0 == rc1 == 0, (err0[-3000:], err1[-3000:])
    return out0 + err0


def test_a_rank_without_a_sample_in_an_epochs_last_step_trains_a_stand_in(tiny_edit_model, tmp_path) -> None:
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(7))
    tables = open_split(store, tiny_edit_model)
    try:
        plan = make_sampler(tables.lengths, 4, BUDGET, 0, 64, 2).global_steps(0)
        assert [[len(b) for b in step] for step in plan][-1] == [1, 0]  # the case under test
        assert all(len(b) * max(int(tables.lengths[i]) for i in b) <= BUDGET for step in plan for b in step if b)
    finally:
        tables.close()
    _train(store, tiny_edit_model, tmp_path / "straight", 6)  # two epochs: steps 3 and 6 have an empty batch
    _train(store, tiny_edit_model, tmp_path / "resumed", 3)
    _train(store, tiny_edit_model, tmp_path / "resumed", 6, resume=True)
    a, b = read_lora(tmp_path / "straight" / "lora")[0], read_lora(tmp_path / "resumed" / "lora")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)  # it trained
