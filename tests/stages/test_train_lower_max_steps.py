"""A run continued to a lower `train.max_steps` (`run all`: `--resume --new-run`). Under a constant LR (with warm-up)
its steps up to the new max_steps are a straight run's: its checkpoint at exactly that step is the result, one below
it is continued, each bit-identical to a straight run to the new max_steps; the run is kept aside whole. Before,
it was kept and trained afresh from step 0. Under a decaying schedule it is still trained afresh, and the line says
why (the rate of every step depends on max_steps)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from schemas import UserError
from stages.train import previous
from stages.train.current import up_to_date
from stages.train.recipe import run
from test_train import assert_same_lora, cfg_of, lora_of, store_dir  # noqa: F401 (the fixture: test_train's store)

CONSTANT = {"warmup_steps": 2, "checkpoint_every": 2, "keep_checkpoints": 5, "ema_decay": 0.9}


@pytest.fixture(scope="module")
def runs(store_dir, tiny_edit_model, tmp_path_factory):  # noqa: F811
    """Straight runs to 3 and 4 steps (the references) and a finished run to 6 (checkpoints 2, 4, 6)."""
    root = tmp_path_factory.mktemp("lower")
    for steps in (3, 4, 6):
        run(cfg_of(max_steps=steps, **CONSTANT), store_dir, tiny_edit_model, root / f"straight{steps}")
    return root


def _copy_of_six(runs: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(runs / "straight6", out)
    return out


def test_a_checkpoint_at_the_lower_max_steps_is_the_result(runs, store_dir, tiny_edit_model, tmp_path, capsys):  # noqa: F811
    out = _copy_of_six(runs, tmp_path)
    six = lora_of(out)
    result = run(cfg_of(max_steps=4, **CONSTANT), store_dir, tiny_edit_model, out, resume=True, new_run=True,
                 skip_if_done=True)  # as `run all`
    assert result.start_step == 4 and result.steps == 4 and not result.losses  # nothing trained
    assert_same_lora(lora_of(out), lora_of(runs / "straight4"))
    assert_same_lora(lora_of(out, "lora_ema"), lora_of(runs / "straight4", "lora_ema"))
    said = capsys.readouterr().out
    assert "train.max_steps 6 -> 4 under a constant LR" in said and "takes its checkpoint step-4" in said
    assert str(result).startswith("nothing left to train: the LoRA of checkpoint step-4")
    # the longer run is kept whole, and the fresh folder holds only the checkpoints up to 4
    assert_same_lora(lora_of(result.kept_previous), six)
    assert sorted(p.name for p in (result.kept_previous / "checkpoints").iterdir()) == ["step-2", "step-4", "step-6"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    assert up_to_date(cfg_of(max_steps=4, **CONSTANT), store_dir, tiny_edit_model, out)  # `run all` again: done
    # max_steps back to 6: `run all` takes the kept run back (trains nothing)
    back = run(cfg_of(max_steps=6, **CONSTANT), store_dir, tiny_edit_model, out, resume=True, new_run=True,
               skip_if_done=True)
    assert back.up_to_date and back.steps == 6
    assert_same_lora(lora_of(out), six)


def test_a_checkpoint_below_the_lower_max_steps_is_continued(runs, store_dir, tiny_edit_model, tmp_path):  # noqa: F811
    out = _copy_of_six(runs, tmp_path)
    result = run(cfg_of(max_steps=3, **CONSTANT), store_dir, tiny_edit_model, out, resume=True, new_run=True)
    assert result.start_step == 2 and result.steps == 3 and len(result.losses) == 1
    assert_same_lora(lora_of(out), lora_of(runs / "straight3"))
    assert_same_lora(lora_of(out, "lora_ema"), lora_of(runs / "straight3", "lora_ema"))
    assert_same_lora(lora_of(out, "checkpoints/step-3/lora"), lora_of(runs / "straight3", "checkpoints/step-3/lora"))
    assert result.kept_previous is not None and (result.kept_previous / "checkpoints" / "step-6").is_dir()


def test_without_new_run_the_refusal_names_the_checkpoint(runs, store_dir, tiny_edit_model, tmp_path):  # noqa: F811
    out = _copy_of_six(runs, tmp_path)
    with pytest.raises(UserError, match=r"already past train\.max_steps \(6 > 4\); under a constant LR .* add "
                                        r"--new-run .* take its checkpoint step-4 as this run's LoRA"):
        run(cfg_of(max_steps=4, **CONSTANT), store_dir, tiny_edit_model, out, resume=True)
    # without --resume: the way on is --resume --new-run (a bare --resume, offered before, is refused as above)
    with pytest.raises(UserError) as refused:
        run(cfg_of(max_steps=3, **CONSTANT), store_dir, tiny_edit_model, out)
    assert "pass --resume to continue it" not in str(refused.value)
    assert "(step-6, past train.max_steps 3); pass --resume --new-run to keep it" in str(refused.value) and \
        "and continue from its checkpoint step-2 (1 step(s) to train)" in str(refused.value), str(refused.value)
    assert not previous.previous_root(out).exists()  # nothing moved


def test_a_decaying_schedule_trains_afresh_and_says_why(store_dir, tiny_edit_model, tmp_path, capsys):  # noqa: F811
    cosine = {**CONSTANT, "lr_schedule": "cosine"}
    out = tmp_path / "run"
    run(cfg_of(max_steps=4, **cosine), store_dir, tiny_edit_model, out)
    capsys.readouterr()
    why = "train.lr_schedule cosine decays the learning rate over train.max_steps"
    # raised: refused on --resume (its steps had another rate), the reason named
    with pytest.raises(UserError, match="train.max_steps: 4 -> 6 \\(" + why):
        run(cfg_of(max_steps=6, **cosine), store_dir, tiny_edit_model, out, resume=True)
    # lowered (a checkpoint at 2 is kept): trained afresh, saying why
    result = run(cfg_of(max_steps=2, **cosine), store_dir, tiny_edit_model, out, resume=True, new_run=True)
    assert result.start_step == 0 and result.steps == 2 and result.kept_previous is not None
    assert why in capsys.readouterr().out


def test_a_kill_before_the_checkpoints_are_linked_loses_nothing(runs, store_dir, tiny_edit_model, tmp_path,  # noqa: F811
                                                                 monkeypatch):
    """Killed once the run is kept, before its checkpoints are in the fresh folder: `run all` again takes the kept run
    back (`take_back_kept`: a run a lower max_steps continues is one these settings resume) and takes its checkpoint,
    instead of training from step 0 in the empty folder."""
    from stages.train import shorter

    out = _copy_of_six(runs, tmp_path)

    def killed(kept, run_dir, max_steps):
        raise KeyboardInterrupt  # as a kill there: nothing linked yet

    monkeypatch.setattr(shorter, "seed", killed)
    settings = dict(resume=True, new_run=True, skip_if_done=True)  # `run all`
    with pytest.raises(KeyboardInterrupt):
        run(cfg_of(max_steps=4, **CONSTANT), store_dir, tiny_edit_model, out, **settings)
    assert not (out / "checkpoints").exists()
    monkeypatch.undo()
    result = run(cfg_of(max_steps=4, **CONSTANT), store_dir, tiny_edit_model, out, **settings)
    assert result.start_step == 4 and result.steps == 4
    assert_same_lora(lora_of(out), lora_of(runs / "straight4"))


def _kept_run(tmp_path: Path) -> tuple[Path, Path]:
    """A kept run with checkpoints 2, 4, 6 (two files each) and a damaged-sample list; an empty fresh RUN."""
    from stages.train import damaged_log

    kept, fresh = tmp_path / "kept", tmp_path / "run"
    for step in (2, 4, 6):
        folder = kept / "checkpoints" / f"step-{step}"
        (folder / "lora").mkdir(parents=True)
        (folder / "lora" / "weights.safetensors").write_bytes(b"w" * step)
        (folder / "resume.json").write_text("{}")
    (kept / damaged_log.NAME).write_text('{"sample": "a", "problem": "truncated"}\n')
    fresh.mkdir()
    return kept, fresh


@pytest.mark.parametrize("renames", [1, 2])
def test_a_kill_while_linking_leaves_no_checkpoint_without_the_damaged_list(tmp_path, monkeypatch, renames):
    """Killed after the n-th checkpoint is committed into the fresh RUN: the rerun resumes from it, so the run's
    damaged-sample list must be there with it (it was copied after the checkpoints: resumed without it, the
    samples the run left out went unlisted, and under train.on_damaged stop the run counted as leaving none out)."""
    import os

    from stages.train import damaged_log, shorter

    kept, fresh = _kept_run(tmp_path)
    real, done = os.rename, []

    def rename(src, dst):
        real(src, dst)
        if Path(dst).name.startswith("step-"):
            done.append(dst)
            if len(done) == renames:
                raise KeyboardInterrupt  # as a SIGKILL right after this commit

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        shorter.seed(kept, fresh, 4)
    monkeypatch.undo()
    assert [p.name for p in (fresh / "checkpoints").iterdir() if not p.name.startswith(".")]  # one committed
    assert damaged_log.read(fresh) == {"a": "truncated"}
    assert damaged_log.read(kept) == {"a": "truncated"}  # the kept run's own list untouched


def test_checkpoints_copied_without_hard_links_are_durable(tmp_path, monkeypatch):
    """Where the filesystem has no hard links the checkpoints are copied: each copy's bytes are fsynced before
    its folder is committed (they were not: a power loss could leave a committed step-N of empty files, which the
    resume refuses as damaged)."""
    import os

    from stages.train import shorter

    kept, fresh = _kept_run(tmp_path)
    synced: set[int] = set()  # the inodes fsynced (under their temp names, then renamed: the same files)
    real_fsync = os.fsync

    def no_link(src, dst, *a, **k):
        raise OSError(1, "no hard links here")

    def fsync(fd):
        synced.add(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(os, "fsync", fsync)
    shorter.seed(kept, fresh, 4)
    monkeypatch.undo()
    files = sorted(str(p) for p in (fresh / "checkpoints").rglob("*") if p.is_file())
    assert [Path(f).relative_to(fresh).as_posix() for f in files] == [
        "checkpoints/step-2/lora/weights.safetensors", "checkpoints/step-2/resume.json",
        "checkpoints/step-4/lora/weights.safetensors", "checkpoints/step-4/resume.json"]
    assert all(os.stat(f).st_ino in synced for f in files), files
    assert (fresh / "checkpoints" / "step-4" / "lora" / "weights.safetensors").read_bytes() == b"w" * 4


def test_run_train_resume_new_run_after_a_kill_before_the_links_takes_the_kept_run_back(runs, store_dir,  # noqa: F811
                                                                                         tiny_edit_model, tmp_path):
    """`run train --resume --new-run` (what `run all` does) killed once the run is kept, before its checkpoints
    are in the fresh RUN (here: RUN gone, as a kill right after the keep's rename leaves it): the rerun was refused
    "nothing to resume, RUN does not exist" before the start that takes the kept run back (`take_back_kept`), and
    its advice (leave out --resume) trained from step 0. Now it takes the kept checkpoint, as `run all` does."""
    from typer.testing import CliRunner

    from pipeline.cli import app
    from schemas.config import dump_config

    out = _copy_of_six(runs, tmp_path)
    previous.keep(out)
    out.rmdir()  # killed between the keep's rename and RUN made again
    config = tmp_path / "config.yaml"
    config.write_text(dump_config(cfg_of(max_steps=4, **CONSTANT)))
    res = CliRunner().invoke(app, ["run", "train", "--config", str(config), "--store", str(store_dir), "--model",
                                   tiny_edit_model, "--out", str(out), "--resume", "--new-run"])
    assert res.exit_code == 0, res.output
    assert "nothing left to train: the LoRA of checkpoint step-4" in res.output, res.output
    assert_same_lora(lora_of(out), lora_of(runs / "straight4"))
    assert any((k / "checkpoints" / "step-6").is_dir() for k in previous.kept_runs(out))  # the run to 6 still kept


def test_a_decaying_schedule_is_not_offered_a_checkpoint_to_continue_from(store_dir, tiny_edit_model, tmp_path):  # noqa: F811
    """A start without --resume over a cosine run past a lower max_steps whose train_config.yaml is gone (an
    earlier release's run, a copy of its checkpoints): the refusal offered `--resume --new-run` to "continue from
    its checkpoint step-2", which trains afresh under a decaying LR."""
    from stages.train.resume import CONFIG_FILE

    cosine = {**CONSTANT, "lr_schedule": "cosine"}
    out = tmp_path / "run"
    run(cfg_of(max_steps=4, **cosine), store_dir, tiny_edit_model, out)
    (out / CONFIG_FILE).unlink()
    with pytest.raises(UserError) as refused:
        run(cfg_of(max_steps=3, **cosine), store_dir, tiny_edit_model, out)
    assert "already holds checkpoints (step-4" in str(refused.value), str(refused.value)
    assert "continue from its checkpoint" not in str(refused.value), str(refused.value)
