"""`--resume` with another batch size, gradient accumulation or token budget: each changes which samples every
optimizer step holds (and so the data position's meaning), so the resume is refused naming the setting (and
only it: grad_accum's training revision is its config's, no release's), and nothing is trained or written. (Another process count is allowed and trains the straight run's LoRA:
tests/stages/test_train_ddp.py; `batch_size` under a token budget: tests/stages/test_budget_batch_size.py.)"""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from stages.train import state as train_state
from stages.train.recipe import run
from train_store import make_train_store, mixed_specs

BASE = {"train.device": "cpu", "train.lora.rank": 4, "train.batch_size": 2, "train.checkpoint_every": 1}


@pytest.mark.parametrize("change, named", [
    ({"train.batch_size": 3}, "train.batch_size: 2 -> 3"),
    ({"train.grad_accum": 2}, "train.grad_accum: 1 -> 2"),
    ({"train.max_tokens_per_batch": 80}, "train.max_tokens_per_batch: None -> 80"),
])
def test_a_resume_with_other_batching_is_refused_naming_it(tiny_edit_model, tmp_path, change, named) -> None:
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(6))
    run(load_config(None, {**BASE, "train.max_steps": 1}), store, tiny_edit_model, out)
    with pytest.raises(train_state.ResumeMismatch) as refused:
        run(load_config(None, {**BASE, "train.max_steps": 2, **change}), store, tiny_edit_model, out, resume=True)
    assert named in str(refused.value) and "--new-run" in str(refused.value), str(refused.value)
    # grad_accum > 1 is its config's training revision 2 under this very release: no release to blame (the line
    # said "this release trains differently" and sent the user after the release that started the run)
    assert "release" not in str(refused.value) and "training revision" not in str(refused.value), str(refused.value)
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [1]
