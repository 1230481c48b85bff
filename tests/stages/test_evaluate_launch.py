"""Single-LoRA evaluate runs in one process. Launched under torchrun (`pipeline launch ... run evaluate`), every rank
evaluated everything into the one report folder: the first took its lock, the others stopped naming that lock, and
torchrun then ended the first too (measured with 2 ranks: exit 1, the lock's line, no report). Now every rank
refuses at once with the same line, before opening anything. (`--all-checkpoints` shares the loss passes between
the ranks: tests/stages/test_evaluate_checkpoints_ranks.py.)"""

from __future__ import annotations

import pytest

from schemas.config import EvaluateConfig
from schemas.errors import UserError
from stages.evaluate import stage


def test_a_multi_process_launch_is_refused_on_every_rank_before_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "report"
    with pytest.raises(UserError, match=r"evaluate of one LoRA runs in one process.*WORLD_SIZE=2") as e:
        stage.run(EvaluateConfig(), tmp_path / "store", "model", tmp_path / "lora", out)
    assert "\n" not in str(e.value)
    assert not out.exists()  # not even the report folder or its lock
