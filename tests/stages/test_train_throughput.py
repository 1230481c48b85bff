"""Throughput options of the train stage on the tiny model: token-budget batches (exact resume, user errors),
prefetch (the same LoRA as inline), attention backends and regional compilation (the same numbers as native)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.lora import read_lora
from pipeline.config import load_config
from schemas import UserError
from stages.train.recipe import run
from train_store import make_train_store, mixed_specs

BASE = {"train.device": "cpu", "train.learning_rate": 2e-3, "train.lora.rank": 4, "train.sigma.sampling": "uniform",
        "train.caption_dropout": 0.3}


def cfg_of(**train):
    return load_config(None, {**BASE, **{f"train.{k}": v for k, v in train.items()}})


def assert_same_lora(a: Path, b: Path):
    la, lb = read_lora(a / "lora")[0], read_lora(b / "lora")[0]
    assert la.keys() == lb.keys()
    for k in la:
        assert torch.equal(la[k], lb[k]), k


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_edit_model):
    root = tmp_path_factory.mktemp("throughput") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(8))  # joint lengths 9..56 tokens
    return root


def test_token_budget_run_resumes_exactly_and_refuses_a_budget_below_the_longest_sample(store_dir, tiny_edit_model, tmp_path):
    # Budget 80: batches of 1 to 4 samples; 5 steps cross an epoch boundary.
    straight = run(cfg_of(max_tokens_per_batch=80, max_steps=5, checkpoint_every=5), store_dir, tiny_edit_model,
                   tmp_path / "straight")
    assert len(straight.epoch_padding) >= 1
    run(cfg_of(max_tokens_per_batch=80, max_steps=2, checkpoint_every=2), store_dir, tiny_edit_model, tmp_path / "resumed")
    run(cfg_of(max_tokens_per_batch=80, max_steps=5, checkpoint_every=5), store_dir, tiny_edit_model,
        tmp_path / "resumed", resume=True)
    assert_same_lora(tmp_path / "straight", tmp_path / "resumed")
    with pytest.raises(UserError, match="max_tokens_per_batch .* longest training sample"):
        run(cfg_of(max_tokens_per_batch=40, max_steps=1), store_dir, tiny_edit_model, tmp_path / "small")


def test_prefetch_trains_the_same_lora_as_inline_and_checkpoints_the_consumed_position(store_dir, tiny_edit_model, tmp_path):
    # batch 2 x accum 2 over 8 samples: 2 steps per epoch, 3 steps cross an epoch boundary. The prefetching run
    # stops at step 2 (its thread has read ahead into epoch 1 by then) and resumes: the checkpoint must hold
    # the position of the micro-batches trained on, not of those read ahead.
    common = {"batch_size": 2, "grad_accum": 2, "max_steps": 3, "checkpoint_every": 3}
    run(cfg_of(**common, prefetch=0), store_dir, tiny_edit_model, tmp_path / "inline")
    ahead = run(cfg_of(**{**common, "max_steps": 2, "checkpoint_every": 2}, prefetch=3), store_dir, tiny_edit_model,
                tmp_path / "ahead")
    assert ahead.steps == 2
    run(cfg_of(**common, prefetch=3), store_dir, tiny_edit_model, tmp_path / "ahead", resume=True)
    assert_same_lora(tmp_path / "inline", tmp_path / "ahead")


def test_packed_attention_and_compiled_blocks_train_the_same_lora(store_dir, tiny_edit_model, tmp_path, monkeypatch):
    from stages.train import build
    from train_store import assert_close_lora

    run(cfg_of(batch_size=4, max_steps=2), store_dir, tiny_edit_model, tmp_path / "native")
    run(cfg_of(batch_size=4, max_steps=2, attention_backend="packed"), store_dir, tiny_edit_model, tmp_path / "packed")
    # Inductor on this 2-core CPU takes minutes per shape: the wiring (regional compile of every block, dynamic
    # shapes, autograd through the compiled blocks) is checked with the aot_eager backend.
    monkeypatch.setattr(build, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    compiled = build.setup_transformer(tiny_edit_model, cfg_of(compile=True).train, torch.device("cpu"))
    assert all(b._compiled_call_impl is not None for b in compiled.transformer_blocks)
    run(cfg_of(batch_size=4, max_steps=2, compile=True), store_dir, tiny_edit_model, tmp_path / "compiled")
    a, b, c = (read_lora(tmp_path / n / "lora")[0] for n in ("native", "packed", "compiled"))
    assert_close_lora(a, b, lr=2e-3, steps=2)
    assert_close_lora(a, c, lr=2e-3, steps=2)
    with pytest.raises(UserError, match="honours the padding mask"):
        run(cfg_of(attention_backend="flash", max_steps=1), store_dir, tiny_edit_model, tmp_path / "bad")
