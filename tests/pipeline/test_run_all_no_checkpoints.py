"""`pipeline launch ... run all` over a run folder without checkpoints (a run holding only its final LoRA): run all
evaluates such a run on its final LoRA in one process, and launched it goes to the checkpoints' evaluate, whose line
advised "evaluate one LoRA without --all-checkpoints", a flag `run all` has not (and one LoRA is evaluated in one
process only), and "train with train.checkpoint_every set", which is always set (> 0)."""

from __future__ import annotations

import pytest

from pipeline import orchestrate
from schemas.config import PipelineConfig
from schemas.errors import UserError


def test_run_all_launched_over_a_run_without_checkpoints_says_what_evaluates_it(tiny_edit_model, tmp_path,
                                                                                 monkeypatch):
    (tmp_path / "run" / "lora").mkdir(parents=True)
    # rank 0 of a launch as `evaluate_run` sees it; evaluate's own collectives stay one process (WORLD_SIZE unset)
    monkeypatch.setattr(orchestrate, "launched", lambda: (2, True))
    paths = orchestrate.Paths(source="", store=str(tmp_path / "store"), model=tiny_edit_model, run=tmp_path / "run",
                              report=tmp_path / "report")
    with pytest.raises(UserError) as e:
        orchestrate.evaluate_run(PipelineConfig(), paths)
    line = str(e.value)
    assert line.startswith("no checkpoints to evaluate: the run folder holds no checkpoints/step-N"), line
    assert "--all-checkpoints" not in line and "checkpoint_every" not in line, line
    assert "`pipeline run evaluate --lora RUN/lora`, or `pipeline run all` not under `pipeline launch`" in line, line
