"""`run all` with settings A, then B, then A again: the third takes A's finished run back from RUN.previous (B's
kept in its place) instead of training A afresh; a kill between the swap's two renames loses neither run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from stages.train import previous
from stages.train.recipe import run
from test_train import REPO, assert_same_lora, cfg_of, lora_of, store_dir  # noqa: F401 (the fixture: test_train's store)
import warm_start


A, B = {"max_steps": 2, "checkpoint_every": 2}, {"max_steps": 2, "checkpoint_every": 2, "learning_rate": 5e-3}


def run_all_train(cfg, store, model, out):
    return run(cfg, store, model, out, resume=True, skip_if_done=True, new_run=True)


def a_then_b(store, model, out):
    """A trained into OUT, then B (A kept in OUT.previous); their LoRAs."""
    run_all_train(cfg_of(**A), store, model, out)
    a = lora_of(out)
    run_all_train(cfg_of(**B), store, model, out)
    return a, lora_of(out)


def test_a_b_a_takes_a_back(store_dir, tiny_edit_model, tmp_path):
    out = tmp_path / "run"
    a, b = a_then_b(store_dir, tiny_edit_model, out)
    result = run_all_train(cfg_of(**A), store_dir, tiny_edit_model, out)
    assert result.up_to_date and result.kept_previous is not None and not result.losses  # nothing trained
    assert_same_lora(lora_of(out), a)
    assert_same_lora(lora_of(result.kept_previous), b)
    assert len(previous.kept_runs(out)) == 1  # A left RUN.previous; B is there
    # other inputs than A's (here: another seed) train afresh, A kept again
    result = run_all_train(cfg_of(**A, seed=7), store_dir, tiny_edit_model, out)
    assert not result.up_to_date and result.start_step == 0 and len(previous.kept_runs(out)) == 2


_KILLED = """
import json
import sys
from pathlib import Path
from pipeline.config import load_config
from stages.train.recipe import run
store, model, out, overrides = sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
run(load_config(None, overrides), store, model, out, resume=True, skip_if_done=True, new_run=True)
"""


def test_a_kill_between_the_renames_loses_neither(store_dir, tiny_edit_model, tmp_path):
    out = tmp_path / "run"
    a, b = a_then_b(store_dir, tiny_edit_model, out)
    from test_train import BASE

    env = {**os.environ, "STORE_CRASH_AT": "take_back_between_renames", "PYTHONPATH": str(REPO)}
    args = {**BASE, **{f"train.{k}": v for k, v in A.items()}}
    done = warm_start.run([sys.executable, "-c", _KILLED, str(store_dir), tiny_edit_model, str(out), json.dumps(args)],
                          env=env, cwd=REPO, timeout=300)  # started warm (tests/warm_start.py)
    assert done.returncode == -9, done.stderr[-2000:]
    assert not out.exists()  # between the renames: both runs under RUN.previous
    kept = previous.kept_runs(out)
    assert len(kept) == 2
    result = run_all_train(cfg_of(**A), store_dir, tiny_edit_model, out)
    assert result.up_to_date and not result.losses
    assert_same_lora(lora_of(out), a)
    (left,) = previous.kept_runs(out)
    assert_same_lora(lora_of(left), b)


def test_a_stopped_then_b_then_a_resumes_a(store_dir, tiny_edit_model, tmp_path):
    """A trained 2 of 4 steps (here: a run of 2, then max_steps 4: what a stopped run leaves), then B, then A
    again: the third takes A's kept run back and resumes it at step 2 (the LoRA of A continued in place), B kept.
    Before, only a finished run was taken back: A's two steps were kept aside and A trained again from step 0.
    The run folder is locked again after the swap (the lock held moved away with B): a second `train` is refused."""
    from stages.train import guard

    plain, out = tmp_path / "plain", tmp_path / "run"
    run_all_train(cfg_of(**A), store_dir, tiny_edit_model, plain)
    run_all_train(cfg_of(**{**A, "max_steps": 4}), store_dir, tiny_edit_model, plain)  # A continued in place
    run_all_train(cfg_of(**A), store_dir, tiny_edit_model, out)
    run_all_train(cfg_of(**B), store_dir, tiny_edit_model, out)
    b = lora_of(out)
    held = []
    real = guard.RunDirLock.__init__

    def second_train_refused(self, run_dir):  # a second `train` into RUN while this one trains in it
        real(self, run_dir)
        held.append(run_dir)
        if len(held) == 2:
            with pytest.raises(Exception, match="held|lock"):
                guard.RunDirLock(Path(run_dir))

    guard.RunDirLock.__init__ = second_train_refused
    try:
        result = run_all_train(cfg_of(**{**A, "max_steps": 4}), store_dir, tiny_edit_model, out)
    finally:
        guard.RunDirLock.__init__ = real
    assert held == [out, out]
    assert result.start_step == 2 and not result.up_to_date
    assert_same_lora(lora_of(out), lora_of(plain))
    (kept,) = previous.kept_runs(out)
    assert result.kept_previous == kept
    assert_same_lora(lora_of(kept), b)


def test_a_train_that_made_run_between_the_renames_stops_the_take_back_in_one_line(store_dir, tiny_edit_model,
                                                                                   tmp_path, monkeypatch):
    """Another `train` into RUN that starts while the take-back has renamed RUN away (RUN missing: it makes RUN and
    takes its lock) makes the second rename fail: one line naming both folders, both runs kept where they are
    (before: a bare OSError traceback out of `run all`)."""
    from schemas import UserError
    from stages.train import guard
    from store import format as fmt

    out = tmp_path / "run"
    a, b = a_then_b(store_dir, tiny_edit_model, out)
    other = []
    real = fmt.crash_point

    def another_train_starts(name):
        if name == "take_back_between_renames":
            other.append(guard.RunDirLock(out))
        real(name)

    monkeypatch.setattr(fmt, "crash_point", another_train_starts)
    with pytest.raises(UserError, match=r"could not take the run kept in .* back into .*made again meanwhile"):
        run_all_train(cfg_of(**A), store_dir, tiny_edit_model, out)
    other[0].release()
    kept = previous.kept_runs(out)
    assert len(kept) == 2
    assert_same_lora(lora_of(kept[0]), b)
    assert_same_lora(lora_of(kept[1]), a)


def test_a_take_back_removes_what_a_killed_take_back_left_of_an_untrained_run(store_dir, tiny_edit_model, tmp_path):
    """A kill while a take-back removed an untrained RUN (`RUN.previous/.untrained-*`) left it for good: the next
    take-back (under RUN's lock: no other is under way) removes it."""
    out = tmp_path / "run"
    a_then_b(store_dir, tiny_edit_model, out)
    left = previous.previous_root(out) / ".untrained-1-2"
    (left / "checkpoints").mkdir(parents=True)
    (left / "checkpoints" / "partial.bin").write_bytes(b"x" * 1024)
    assert run_all_train(cfg_of(**A), store_dir, tiny_edit_model, out).up_to_date
    assert not left.exists()
