"""A run stopped (e.g. out of memory) resumes with gradient checkpointing turned on, as the OOM advice says, and
trains the same LoRA as one run without it. Before: the setting was in the run fingerprint, so the resume was
refused ("train config fingerprint"), and `pipeline run all` moved the run aside and trained again from step 0."""

from __future__ import annotations

import re

import pytest

from schemas.errors import UserError
from stages.train.recipe import run
from test_train import assert_same_lora, cfg_of, lora_of, store_dir  # noqa: F401 - the module's store fixture


# train.uncheckpointed_blocks (the first N blocks left out of checkpointing) is a memory setting too: a resume may
# change it (before it existed, the key was refused as unknown)
@pytest.mark.parametrize("memory", [{"gradient_checkpointing": True},
                                    {"gradient_checkpointing": True, "uncheckpointed_blocks": 1}])
def test_a_resume_may_turn_gradient_checkpointing_on(memory, store_dir, tiny_edit_model, tmp_path):  # noqa: F811
    run(cfg_of(max_steps=4, checkpoint_every=2), store_dir, tiny_edit_model, tmp_path / "straight")
    out = tmp_path / "run"
    run(cfg_of(max_steps=2, checkpoint_every=2), store_dir, tiny_edit_model, out)
    resumed = run(cfg_of(max_steps=4, checkpoint_every=2, **memory), store_dir, tiny_edit_model, out, resume=True)
    assert resumed.start_step == 2 and resumed.steps == 4
    assert_same_lora(lora_of(out), lora_of(tmp_path / "straight"))


@pytest.mark.parametrize("memory, refused", [
    ({"uncheckpointed_blocks": 1}, "train.uncheckpointed_blocks (1) leaves blocks out of gradient checkpointing, "
                                   "which is off"),
    ({"offload": "blocks", "offload_blocks_on_device": 1, "uncheckpointed_blocks": 2},
     "train.uncheckpointed_blocks (2) exceeds train.offload_blocks_on_device (1): an offloaded block must be "
     "checkpointed"),
])
def test_blocks_left_out_of_checkpointing_that_cannot_be_are_refused(memory, refused, store_dir, tiny_edit_model,
                                                                    tmp_path):  # noqa: F811
    """One line before anything loads: leaving blocks out of checkpointing that is off, or an offloaded block
    (it would keep its device weights until the backward: no memory saved by the offload)."""
    with pytest.raises(UserError, match=re.escape(refused)) as err:
        run(cfg_of(max_steps=2, **memory), store_dir, tiny_edit_model, tmp_path / "run")
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()
