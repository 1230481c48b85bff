"""Out of memory in a training step names what to change. With train.uncheckpointed_blocks set (which
`pipeline plan --gpu-memory` may have advised raising: each such block keeps its activations through the
backward), lowering it is among the advice; before, the line left it out. Unset, the advice is as before. What is
set already (checkpointing here) is not advised again (before, "set train.gradient_checkpointing" was)."""

from __future__ import annotations

import pytest
import torch

import stages.train.recipe as recipe
from pipeline.config import load_config
from schemas.errors import UserError
from train_store import make_train_store, mixed_specs

SETS = {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.max_steps": 1,
        "train.gradient_checkpointing": True}


@pytest.mark.parametrize("blocks", [0, 1])
def test_a_steps_out_of_memory_advises_lowering_uncheckpointed_blocks_when_set(tiny_edit_model, tmp_path,
                                                                             monkeypatch, blocks):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")

    monkeypatch.setattr(recipe, "backward_of", out_of_memory)
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(4))
    cfg = load_config(None, {**SETS, "train.uncheckpointed_blocks": blocks})
    with pytest.raises(UserError) as e:
        recipe.run(cfg, store, tiny_edit_model, tmp_path / "run")
    line = str(e.value)
    assert line.startswith("ran out of memory in optimizer step 1 (CUDA out of memory."), line
    assert "lower train.batch_size or train.max_tokens_per_batch" in line, line
    said = "lower train.uncheckpointed_blocks (1: blocks that keep their activations)"
    assert (said in line) == (blocks == 1), line
    # checkpointing is on (SETS): the advice names what is not set yet, not it
    assert "train.gradient_checkpointing" not in line and "set train.offload: blocks or train.quantize_base" in line, line


def test_the_step_advice_is_built_once_per_run(tiny_edit_model, tmp_path, monkeypatch):
    """Every step hands its out-of-memory advice to `fails_alone`: built from the run's config once, not at every
    optimizer step (before: 3 builds for 3 steps)."""
    built = []
    real = recipe.step_oom_advice
    monkeypatch.setattr(recipe, "step_oom_advice", lambda tc: built.append(tc) or real(tc))
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(4))
    result = recipe.run(load_config(None, {**SETS, "train.max_steps": 3}), store, tiny_edit_model, tmp_path / "run")
    assert result.steps == 3 and len(built) == 1, len(built)
