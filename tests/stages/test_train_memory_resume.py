"""A run stopped (e.g. out of memory) resumes with gradient checkpointing turned on, as the OOM advice says, and
trains the same LoRA as one run without it. Before: the setting was in the run fingerprint, so the resume was
refused ("train config fingerprint"), and `pipeline run all` moved the run aside and trained again from step 0."""

from __future__ import annotations

from stages.train.recipe import run
from test_train import assert_same_lora, cfg_of, lora_of, store_dir  # noqa: F401 - the module's store fixture


def test_a_resume_may_turn_gradient_checkpointing_on(store_dir, tiny_edit_model, tmp_path):  # noqa: F811
    run(cfg_of(max_steps=4, checkpoint_every=2), store_dir, tiny_edit_model, tmp_path / "straight")
    out = tmp_path / "run"
    run(cfg_of(max_steps=2, checkpoint_every=2), store_dir, tiny_edit_model, out)
    resumed = run(cfg_of(max_steps=4, checkpoint_every=2, gradient_checkpointing=True), store_dir, tiny_edit_model,
                  out, resume=True)
    assert resumed.start_step == 2 and resumed.steps == 4
    assert_same_lora(lora_of(out), lora_of(tmp_path / "straight"))
