"""`pipeline plan`'s per-block activation terms per model family, against what a block really keeps for the backward
(tests/models/block_activations.py: a block set up as the trainer sets it up, one sample under bf16 autocast, the
saved storages counted once). Before, one Edit-counted constant (21 D per token) planned Qwen-Image-2.1 too, whose
single-stream blocks with a SwiGLU MLP keep ~29.5: its activations were planned 29 % under. 512 wide (4 heads of
128), 640 tokens: the full widths' figures (bench/block_activations.py) within 1 %, in seconds."""

from __future__ import annotations

import pytest

from block_activations import block_backward_peak, block_saved, lora_model
from models import memory_plan as mp

HEADS, TOKENS = 4, 640
FAMILIES = ["edit", "qwen-image-2.1"]


@pytest.fixture(scope="module")
def models():
    return {family: lora_model(family, HEADS) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_planned_block_activations_are_what_a_block_saves(family, models):
    """The plan's activations without checkpointing, per block, against the saved storages of one block: at most
    10 % above (Edit keeps its earlier count, 21, ~8 % above this one) and at most 3 % under."""
    model = models[family]
    counts = mp.counts_from_model(model)
    saved = block_saved(model, TOKENS)
    plan = mp.train_plan("", "bfloat16", "none", 1, saved.tokens, False, 16, counts=counts)
    per_block = plan.parts["activations"] / counts.blocks
    print(f"{family}: measured {saved.units:.2f} D per token, planned {per_block / saved.per_token:.3f} of it")
    assert 0.97 < per_block / saved.per_token < 1.10, (per_block, saved.per_token)
    if family == "qwen-image-2.1":  # the S² mask copy each block saves: qwen21_mask_bytes' term, not a per-token one
        assert saved.square == mp.qwen21_mask_bytes(1, saved.tokens, 2, 1) - mp.qwen21_mask_bytes(1, saved.tokens, 2, 0)
        # planned from the counts alone too (no model name): the family is the counts'
        assert plan.parts["block-causal mask"] == mp.qwen21_mask_bytes(1, saved.tokens, 2, counts.blocks)
    else:
        assert saved.square == 0 and "block-causal mask" not in plan.parts


def test_the_21_backward_working_set_adds_what_its_block_backward_adds(models):
    """A 2.1 block's backward rises above its saved tensors by more than an Edit block's (every token through a
    3D-wide SwiGLU vs the image stream's share of the tokens): the plan's 2.1 working set adds that difference (to
    Edit's measured-against-peaks 12), rounded up by at most half a unit."""
    edit, qwen21 = (block_backward_peak(models[f], TOKENS) for f in FAMILIES)
    planned = mp.QWEN21_ACTIVATIONS.backward_workset - mp.EDIT_ACTIVATIONS.backward_workset
    print(f"backward peaks above the saved: edit {edit:.2f}, 2.1 {qwen21:.2f}; planned difference {planned}")
    assert qwen21 - edit <= planned <= qwen21 - edit + 0.5
    assert mp.counts_from_model(models["qwen-image-2.1"]).activations is mp.QWEN21_ACTIVATIONS
    assert mp.counts_from_model(models["edit"]).activations is mp.EDIT_ACTIVATIONS
