"""Train never trains on damaged features, never writes a non-finite LoRA, holds its run folder alone, detects a
damaged checkpoint on resume, and turns a full disk into one line with nothing left half-written."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import load_config
from schemas import UserError
from stages.train import damaged_log, guard as train_guard, saving as train_saving, state as train_state
from stages.train.state import ResumeRecord
from stages.train.recipe import run
from store import Store
from store.integrity import DamagedData
from damage import flip_bit, key_at, sample_byte
from train_store import make_train_store, mixed_specs, open_split as open_train_tables

runner = CliRunner()
BASE = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 2e-3, "train.lora.rank": 4,
        "train.sigma.sampling": "uniform"}


def cfg_of(**train_cfg):
    return load_config(None, {**BASE, **{f"train.{k}": v for k, v in train_cfg.items()}})


@pytest.fixture
def damaged_store(tmp_path, tiny_edit_model) -> tuple[Path, str]:
    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(8))
    key = key_at(root, "vae", 3)
    flip_bit(*sample_byte(root, "vae", key, "target"), 6)
    return root, key


def test_cli_train_refuses_a_damaged_sample_in_one_line(damaged_store, tiny_edit_model, tmp_path):
    root, key = damaged_store
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", "train", "--store", str(root), "--model", tiny_edit_model, "--out", str(out),
                              "--max-steps", "8", "--batch-size", "2", "--device", "cpu"])
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    line = [ln for ln in res.output.splitlines() if "error:" in ln][0]
    assert key in line and "table 'vae' v1" in line and "pipeline store repair" in line and "shard-r00-" in line
    assert not (out / "lora").exists()


def test_skip_damaged_reports_them_and_threshold_stops(damaged_store, tiny_edit_model, tmp_path):
    """The limit is judged as the samples are read: 1 damaged of 8 > 10% once it is met (an epoch of 4 steps
    reads every sample); 20% lets the run go on, the sample listed."""
    root, key = damaged_store
    with pytest.raises(UserError, match=r"1 of the \d+ 'train' samples read so far .* are damaged .*more than "
                                        r"train.max_damaged_fraction = 0.1 of 8 .*damaged_samples.jsonl"):
        run(cfg_of(max_steps=4, on_damaged="skip", max_damaged_fraction=0.1), root, tiny_edit_model, tmp_path / "a")
    assert list(damaged_log.read(tmp_path / "a")) == [key]
    result = run(cfg_of(max_steps=4, on_damaged="skip", max_damaged_fraction=0.2), root, tiny_edit_model,
                 tmp_path / "b")
    assert result.steps == 4
    report = damaged_log.read(tmp_path / "b")
    assert list(report) == [key] and "damaged" in report[key]


def test_a_step_of_damaged_samples_only_is_counted_as_such(damaged_store, tiny_edit_model, tmp_path, capsys):
    """batch_size 1, one damaged sample of 8: its step has no intact sample and makes no update. It was counted
    with the non-finite steps on_nonfinite=skip_step skips, and the summary said "1 non-finite step(s) skipped"
    on a run with no non-finite value; now it says what it is."""
    root, key = damaged_store
    result = run(cfg_of(max_steps=8, batch_size=1, on_damaged="skip", max_damaged_fraction=0.2), root,
                 tiny_edit_model, tmp_path / "run")
    line = str(result)
    assert "non-finite" not in line and "1 step(s) with every sample damaged, no update" in line, line
    assert len(result.damaged_steps) == 1 and result.skipped_steps == []
    said = capsys.readouterr().out
    assert said.count(f"optimizer step {result.damaged_steps[0]}: every sample damaged") == 1, said


def test_skip_reads_no_sample_before_step_0_and_each_sample_once(damaged_store, tiny_edit_model, tmp_path,
                                                                 monkeypatch):
    """on_damaged=skip used to CRC-read the whole split before step 0 (terabytes at 1M samples, then read again
    by the training). Now opening reads no sample's bytes, and a training of one epoch checks each sample of
    each table exactly once - the damaged one included, left out where it was met."""
    from store.sample_check import SampleCheck

    root, key = damaged_store
    checked: dict[tuple[str, int], int] = {}
    real = SampleCheck.bytes_problem

    def counting(self, i, *a, **k):
        checked[(self.view.dir.parent.name, i)] = checked.get((self.view.dir.parent.name, i), 0) + 1
        return real(self, i, *a, **k)

    monkeypatch.setattr(SampleCheck, "bytes_problem", counting)
    with open_train_tables(root, tiny_edit_model, on_damaged="skip") as tables:
        assert len(tables) == 8 and not checked and not tables.damaged  # nothing read to open
    for check_ahead in (32, 0):  # the check-ahead thread, and inline checks
        checked.clear()
        result = run(cfg_of(max_steps=4, on_damaged="skip", max_damaged_fraction=0.2, check_ahead=check_ahead),
                     root, tiny_edit_model, tmp_path / f"run{check_ahead}")
        assert result.steps == 4
        assert sorted(checked) == [(t, i) for t in ("text", "vae") for i in range(8)], checked
        assert set(checked.values()) == {1}, checked  # once each: no pre-pass, the damaged one never again
        assert list(damaged_log.read(tmp_path / f"run{check_ahead}")) == [key]


def test_a_skipped_sample_trains_the_lora_of_a_store_without_it(tmp_path, tiny_edit_model):
    """With every sample in one batch the plan does not depend on the damaged sample, so the run that meets it
    and leaves it out trains the LoRA of a store that never held it: each step is the mean over the samples it
    trained on (the planned count corrected by the damaged count on the loss all-reduce)."""
    from models.lora import read_lora
    from train_store import assert_close_lora, key_of

    damaged, absent = tmp_path / "damaged", tmp_path / "absent"
    make_train_store(damaged, tiny_edit_model, mixed_specs(8))
    flip_bit(*sample_byte(damaged, "vae", key_of(3), "target"), 6)
    make_train_store(absent, tiny_edit_model, mixed_specs(8), skip_vae={3})  # sample 3 not in the join
    cfg = cfg_of(max_steps=3, batch_size=8, on_damaged="skip", max_damaged_fraction=0.2, max_dropped_fraction=0.2)
    a = run(cfg, damaged, tiny_edit_model, tmp_path / "a")
    b = run(cfg, absent, tiny_edit_model, tmp_path / "b")
    assert [round(x, 5) for x in a.losses] == [round(x, 5) for x in b.losses]
    assert_close_lora(read_lora(tmp_path / "a" / "lora")[0], read_lora(tmp_path / "b" / "lora")[0], lr=2e-3,
                      steps=3)
    assert list(damaged_log.read(tmp_path / "a")) == [key_of(3)]


def test_a_share_all_damaged_runs_a_zero_weight_stand_in(damaged_store, tiny_edit_model):
    """A rank whose whole share of a micro-batch is damaged still runs a forward and backward (DDP's all-reduce
    waits for it): on an intact sample of the step, every token weight 0; with on_damaged=stop it raises."""
    from stages.train.damaged import DamagedRows
    from stages.train.prefetch import prepare_share

    root, key = damaged_store
    tc = cfg_of(on_damaged="skip").train
    with open_train_tables(root, tiny_edit_model, on_damaged="skip") as tables:
        bad = tables.keys.array.to_pylist().index(key)
        other = (bad + 1) % len(tables)
        rows = DamagedRows(skip=True)
        flow = prepare_share(tables, tc, [bad], [[bad], [other]], 0, torch.device("cpu"), torch.float32, rows)
        assert list(rows.damaged_of([bad, other])) == [bad]
        assert len(flow.weights) == 1 and all(float(w.abs().sum()) == 0 for w in flow.weights)
        with pytest.raises(DamagedData, match=key):
            prepare_share(tables, tc, [bad], [[bad], [other]], 0, torch.device("cpu"), torch.float32)


def test_evaluate_refuses_a_damaged_val_sample(tmp_path, tiny_edit_model):
    from stages.train.data import load

    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4, 4))
    r = Store(root).reader("text")
    val = sorted(k for k, s in zip(r.keys(), r.manifest.column("split").to_pylist()) if s == "val")
    key = val[0]
    flip_bit(*sample_byte(root, "text", key, "prompt_embeds"), 6)
    tables = open_train_tables(root, tiny_edit_model, split="val", section="evaluate")  # what evaluate reads
    with pytest.raises(DamagedData, match=f"table 'text' v1 .*sample {key}"):
        [load(tables, k) for k in tables.keys]


@pytest.mark.parametrize("value", [float("inf"), 1e38])
def test_nonfinite_loss_stops_naming_step_and_sample_and_writes_no_lora(tmp_path, tiny_edit_model, value):
    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4), poison={2: value})
    from train_store import key_of

    bad_key = key_of(2)
    out = tmp_path / "run"
    with pytest.raises(train_guard.NonFiniteError, match=rf"optimizer step \d+: non-finite loss of samples .*{bad_key}"):
        run(cfg_of(max_steps=4, checkpoint_every=1), root, tiny_edit_model, out)
    assert not (out / "lora").exists()
    for _, ckpt in train_state.complete_checkpoints(out / "checkpoints"):  # earlier checkpoints: finite
        from models.lora import read_lora

        assert all(torch.isfinite(v).all() for v in read_lora(ckpt / "lora")[0].values())
    result = run(cfg_of(max_steps=4, on_nonfinite="skip_step"), root, tiny_edit_model, tmp_path / "run2")
    assert result.skipped_steps and result.steps == 4
    from models.lora import read_lora

    assert all(torch.isfinite(v).all() for v in read_lora(tmp_path / "run2" / "lora")[0].values())


def test_second_train_into_the_same_out_is_refused_naming_the_holder(tmp_path, tiny_edit_model):
    import os
    import socket

    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    out = tmp_path / "run"
    held = train_guard.RunDirLock(out)  # another run holds the folder
    try:
        with pytest.raises(UserError, match=rf"run folder .* is being written by pid {os.getpid()} on {socket.gethostname()}"):
            run(cfg_of(max_steps=1), root, tiny_edit_model, out)
    finally:
        held.release()
    assert run(cfg_of(max_steps=1), root, tiny_edit_model, out).steps == 1  # free again


@pytest.mark.parametrize("name", ["optimizer.safetensors", "lora/pytorch_lora_weights.safetensors",
                                  "rng-rank00.safetensors", "scheduler.json", "resume.json"])
def test_damaged_checkpoint_is_named_and_the_previous_offered(tmp_path, tiny_edit_model, name):
    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    out = tmp_path / "run"
    run(cfg_of(max_steps=2, checkpoint_every=1), root, tiny_edit_model, out)
    path = out / "checkpoints" / "step-2" / name
    flip_bit(path, path.stat().st_size // 2, 0)
    with pytest.raises(train_state.CheckpointDamaged, match=rf"step-2: {'resume.json' if name == 'resume.json' else name}"
                       r".*damaged.*previous checkpoint step-1 is intact"):
        run(cfg_of(max_steps=3, checkpoint_every=1), root, tiny_edit_model, out, resume=True)


@pytest.mark.parametrize("lost", ["step-2", "all"])
def test_a_checkpoint_without_its_resume_record_is_named_not_skipped(tmp_path, tiny_edit_model, lost):
    """A committed `step-N/` always holds resume.json (it is renamed in whole); one without it was damaged (a
    partial copy of the run, a deleted file). Before, --resume skipped it without a word: an earlier checkpoint
    resumed, or with none left step 0, and the damaged folders were overwritten and pruned."""
    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    out = tmp_path / "run"
    run(cfg_of(max_steps=2, checkpoint_every=1), root, tiny_edit_model, out)
    shutil.rmtree(out / "lora")  # as a run killed before its final LoRA
    for step in ([2] if lost == "step-2" else [1, 2]):
        (out / "checkpoints" / f"step-{step}" / "resume.json").unlink()
    offer = "previous checkpoint step-1 is intact" if lost == "step-2" else "no intact earlier checkpoint is left"
    with pytest.raises(train_state.CheckpointDamaged, match=rf"step-2: resume.json is missing.*{offer}"):
        run(cfg_of(max_steps=3, checkpoint_every=1), root, tiny_edit_model, out, resume=True)
    assert (out / "checkpoints" / "step-2" / "optimizer.safetensors").is_file()  # nothing overwritten



def _files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _run_without_intact_checkpoints(tmp_path, model, how: str) -> tuple[Path, Path, dict[str, bytes]]:
    """A run stopped at step 2 (checkpoints 1 and 2, no final LoRA) that no intact checkpoint is left of: both lost
    their resume.json (`unrecorded`), or the only one kept has a flipped bit (`flipped`). (store, out, its
    checkpoints' files)."""
    root = tmp_path / "store"
    make_train_store(root, model, mixed_specs(4))
    out = tmp_path / "run"
    run(cfg_of(max_steps=2, checkpoint_every=1, keep_checkpoints=2 if how == "unrecorded" else 1), root, model, out)
    shutil.rmtree(out / "lora")  # as a run killed before its final LoRA
    if how == "unrecorded":
        for step in (1, 2):
            (out / "checkpoints" / f"step-{step}" / "resume.json").unlink()
    else:
        path = out / "checkpoints" / "step-2" / "optimizer.safetensors"
        flip_bit(path, path.stat().st_size // 2, 0)
    return root, out, _files_of(out / "checkpoints")


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_left_without_an_intact_checkpoint_is_never_trained_over(tmp_path, tiny_edit_model, resume):
    """Checkpoint folders that all lost their resume.json are still a run. Before, a start without --resume took
    the folder for an empty one and trained over them (step-1 and step-2 rewritten), and --resume's line only
    said to use a new --out. Now both name the damaged checkpoint and --new-run, and leave every file as it was."""
    root, out, files = _run_without_intact_checkpoints(tmp_path, tiny_edit_model, "unrecorded")
    with pytest.raises(train_state.CheckpointDamaged, match=r"step-2: resume.json is missing; no intact earlier "
                       rf"checkpoint is left to continue from: add --new-run to keep this run \(moved to "
                       rf"{out}.previous/N-TIME"):
        run(cfg_of(max_steps=3, checkpoint_every=1), root, tiny_edit_model, out, resume=resume)
    assert _files_of(out / "checkpoints") == files


def test_resume_into_a_folder_of_damaged_checkpoints_only_is_not_nothing_to_resume(tmp_path):
    """A copy of a run's checkpoints/ alone whose resume.json files were lost: `--resume` said "nothing to resume,
    RUN holds no checkpoints/ and no train_config.yaml" (it holds checkpoints/). Now the start goes on to name the
    damaged checkpoint and --new-run (above)."""
    from stages.train.resume import nothing_to_resume

    (tmp_path / "run" / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-2" / "optimizer.safetensors").write_bytes(b"state")
    assert nothing_to_resume(tmp_path / "run") is None
    assert "holds no checkpoints/" in nothing_to_resume(tmp_path / "run" / "checkpoints" / "step-2")

def test_a_damaged_checkpoint_is_named_before_the_start_asks_for_resume(tmp_path, tiny_edit_model):
    """step-2 lost its resume.json, step-1 is intact: a start without --resume used to say "already holds
    checkpoints (step-1); pass --resume to continue it", and only that --resume named step-2 as damaged. The
    damaged checkpoint comes first now."""
    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    out = tmp_path / "run"
    run(cfg_of(max_steps=2, checkpoint_every=1), root, tiny_edit_model, out)
    (out / "checkpoints" / "step-2" / "resume.json").unlink()
    with pytest.raises(train_state.CheckpointDamaged, match="step-2: resume.json is missing; the previous checkpoint "
                                                            "step-1 is intact"):
        run(cfg_of(max_steps=3, checkpoint_every=1), root, tiny_edit_model, out)


@pytest.mark.parametrize("how", ["unrecorded", "flipped"])
def test_resume_new_run_keeps_a_run_without_an_intact_checkpoint_and_trains_afresh(tmp_path, tiny_edit_model, how):
    """`--resume --new-run` keeps a run that cannot be continued (docs/train.md): one with no intact checkpoint
    left is such a run. Before, it stopped on the damaged checkpoint. Now it is kept whole under RUN.previous and
    the new run trains from step 0."""
    root, out, files = _run_without_intact_checkpoints(tmp_path, tiny_edit_model, how)
    result = run(cfg_of(max_steps=1, checkpoint_every=1), root, tiny_edit_model, out, resume=True, new_run=True)
    assert result.kept_previous is not None and result.start_step == 0 and result.steps == 1
    assert result.kept_previous.parent == out.with_name("run.previous")
    assert _files_of(result.kept_previous / "checkpoints") == files  # nothing deleted or changed
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [1]


def test_a_take_back_keeps_a_run_folder_holding_only_damaged_checkpoints(tmp_path):
    """`run all`'s take-back renames the run RUN holds away first: kept when it is a trained run, removed when it
    is not. A `step-N/` without resume.json is part of a run: before, such a RUN counted as untrained and was
    deleted."""
    from stages.train import previous

    out, kept = tmp_path / "run", tmp_path / "run.previous" / "1-20260101T000000Z"
    (out / "checkpoints" / "step-3").mkdir(parents=True)
    (out / "checkpoints" / "step-3" / "optimizer.safetensors").write_bytes(b"the only copy")
    (kept / "lora").mkdir(parents=True)
    moved = previous.take_back(out, kept)
    assert moved is not None and (moved / "checkpoints" / "step-3" / "optimizer.safetensors").read_bytes() == \
        b"the only copy"
    assert (out / "lora").is_dir()

def test_a_resume_record_from_a_newer_release_is_not_called_damaged(tmp_path):
    """resume.json written by a newer release (a field this code does not know, or a higher format) is intact:
    the error says to upgrade, not that the checkpoint is damaged (a user would then delete a good run). Before: a
    new field read as "damaged or unreadable", a higher format named no cause. A flipped bit stays damage."""
    from dataclasses import asdict

    from store.checksum import seal

    step2 = tmp_path / "checkpoints" / "step-2"
    step2.mkdir(parents=True)
    record = train_state.ResumeRecord(step=2, epoch=0, batch_in_epoch=2, config_fingerprint="c",
                                      tables={"text": "v1"}, store="/s", model_fingerprint="m", world_size=1)
    path = step2 / train_state.RESUME_JSON
    for newer, says in [({"loss_scale": 1.0}, r"format 1 with field 'loss_scale' this one does not know"),
                        ({"format": train_state.RESUME_FORMAT + 1},
                         rf"format {train_state.RESUME_FORMAT + 1}, this one reads up to {train_state.RESUME_FORMAT}")]:
        path.write_bytes(seal({**asdict(record), **newer, "files": {}}))
        with pytest.raises(UserError, match=rf"written by a newer version of pipeline \({says}\): upgrade, "
                                            "or start a new --out") as e:
            train_state.ResumeRecord.read(path)
        assert not isinstance(e.value, train_state.CheckpointDamaged)
    flip_bit(path, path.stat().st_size // 2, 0)
    with pytest.raises(train_state.CheckpointDamaged, match="resume.json is damaged"):
        train_state.ResumeRecord.read(path)


def _checkpoint_at_step_2(tmp_path, model):
    """A run stopped at step 2 with its checkpoint (EMA on): (store, out, checkpoint folder, file -> size)."""
    root = tmp_path / "store"
    make_train_store(root, model, mixed_specs(4))
    out = tmp_path / "run"
    run(cfg_of(max_steps=2, checkpoint_every=2, ema_decay=0.9), root, model, out)
    step2 = out / "checkpoints" / "step-2"
    sizes = {p.relative_to(step2).as_posix(): p.stat().st_size for p in step2.rglob("*") if p.is_file()}
    return root, out, step2, sizes


def test_a_resume_reads_each_checkpoint_file_once(tmp_path, tiny_edit_model, monkeypatch):
    """The resume's check (sizes and CRC32Cs against resume.json) and its load share one read of each file. Before:
    every file was read twice per rank (once to check, once to load), doubling a shared filesystem's load when
    many ranks resume at once."""
    from read_counter import count_reads_under

    root, out, step2, sizes = _checkpoint_at_step_2(tmp_path, tiny_edit_model)
    assert {"lora/pytorch_lora_weights.safetensors", "optimizer.safetensors", "ema.safetensors",
            "rng-rank00.safetensors", "scheduler.json", "resume.json"} <= set(sizes)
    reads = count_reads_under(monkeypatch, step2, ("stages.train.state", "stages.train.ema", "models.lora"))
    resumed = run(cfg_of(max_steps=3, checkpoint_every=100, ema_decay=0.9), root, tiny_edit_model, out, resume=True)
    monkeypatch.undo()
    assert resumed.start_step == 2
    assert dict(reads) == sizes, (dict(reads), sizes)


def test_a_resume_keeps_no_more_checkpoint_bytes_than_its_budget(tmp_path, tiny_edit_model, monkeypatch):
    """The bytes the check keeps for the load are held while the base model loads, on every rank of a node: they
    stay within `KEEP_MAX_BYTES` (a large LoRA's optimizer state and EMA reach GBs). A file past the budget is
    checked as streamed and read again by the load, which restores it. Before: the whole checkpoint was kept."""
    from read_counter import count_reads_under

    root, out, step2, sizes = _checkpoint_at_step_2(tmp_path, tiny_edit_model)
    checked = {k: n for k, n in sizes.items() if k != train_state.RESUME_JSON}
    big = max(checked, key=checked.get)
    budget = sum(checked.values()) - checked[big]  # room for every file but the largest
    monkeypatch.setattr(train_state, "KEEP_MAX_BYTES", budget, raising=False)
    kept: dict[str, bytes] = {}
    train_state.ResumeRecord.read(step2 / train_state.RESUME_JSON, keep=kept)
    assert sum(map(len, kept.values())) <= budget and set(kept) == set(checked) - {big}, (big, sorted(kept))
    reads = count_reads_under(monkeypatch, step2, ("stages.train.state", "stages.train.ema", "models.lora"))
    resumed = run(cfg_of(max_steps=3, checkpoint_every=100, ema_decay=0.9), root, tiny_edit_model, out, resume=True)
    monkeypatch.undo()
    assert resumed.start_step == 2
    assert dict(reads) == {**sizes, big: 2 * sizes[big]}, (dict(reads), sizes)  # checked, then loaded


# ---------------------------------------------------------------------------------------------- full disk


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_during_checkpoint_and_final_lora_is_one_line_and_rerun_completes(tmp_path, tiny_edit_model,
                                                                                    monkeypatch):
    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    out = tmp_path / "run"
    args = ["run", "train", "--store", str(root), "--model", tiny_edit_model, "--out", str(out), "--max-steps", "2",
            "--batch-size", "2", "--device", "cpu"]
    real = train_state.save_optimizer
    real_save_lora = train_saving.save_lora

    def half_then_full(optimizer, folder):
        real(optimizer, folder)
        (folder / "optimizer.safetensors").write_bytes(b"half")
        _enospc()

    monkeypatch.setattr(train_state, "save_optimizer", half_then_full)
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "disk full while writing checkpoint step-2" in res.output and "B free" in res.output
    # what to run next: a plain rerun would be refused (the folder holds checkpoints)
    assert "rerun with --resume to continue from the last committed checkpoint" in res.output, res.output
    assert not list((out / "checkpoints").iterdir())  # the temp checkpoint folder was removed
    monkeypatch.setattr(train_state, "save_optimizer", real)

    from safetensors import SafetensorError

    def lora_full(*_a, **_k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                              "\"No space left on device\" }) (os error 28)")

    monkeypatch.setattr(train_saving, "save_lora", lambda t, d, **_: (Path(d).mkdir(parents=True, exist_ok=True), lora_full()))
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and "disk full while writing checkpoint step-2" in res.output
    def final_lora_full(t, d, **kw):  # checkpoints save fine; the final LoRA hits the full disk
        if Path(d).name == ".lora.tmp":
            Path(d).mkdir(parents=True, exist_ok=True)
            (Path(d) / "pytorch_lora_weights.safetensors").write_bytes(b"half")
            lora_full()
        return real_save_lora(t, d, **kw)

    monkeypatch.setattr(train_saving, "save_lora", final_lora_full)
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and "disk full while writing the final LoRA" in res.output, res.output
    assert "rerun with --resume" in res.output, res.output
    assert not (out / ".lora.tmp").exists() and not (out / "lora").exists()
    assert train_state.latest_checkpoint(out / "checkpoints").name == "step-2"  # the committed checkpoint is kept
    monkeypatch.undo()
    res = runner.invoke(app, args + ["--resume"])
    assert res.exit_code == 0, res.output
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]


def test_run_alls_full_disk_line_names_its_own_rerun_not_a_flag_it_lacks(tmp_path, tiny_edit_model, monkeypatch):
    """`run all` trains with resume on (a rerun continues by itself) and has no --resume: its full disk's line said
    'rerun with --resume', which `pipeline run all --resume` refuses as an unknown option."""
    from pipeline.orchestrate import Paths, stages

    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    train = dict(stages())["train"]  # run all's own call of the train stage
    paths = Paths(str(tmp_path / "src"), str(root), tiny_edit_model, tmp_path / "run", tmp_path / "report")
    cfg = load_config(None, {"train.max_steps": 2, "train.batch_size": 2, "train.device": "cpu"})
    monkeypatch.setattr(train_state, "save_optimizer", _enospc)
    with pytest.raises(UserError, match="disk full while writing checkpoint step-2") as full:
        train(cfg, paths)
    assert str(full.value).endswith("; rerun the same command to continue from the last committed checkpoint")


def test_a_kill_between_the_final_loras_never_leaves_a_run_that_passes_for_finished(tmp_path, tiny_edit_model,
                                                                                    monkeypatch):
    """With EMA on, the final LoRA and the EMA LoRA are two commits. Before, `lora/` came first: a kill between the
    two left it alone, newer than the last checkpoint, and `run all`'s up-to-date check took the run for finished
    (its lora_ema/ missing). Now lora_ema/ comes first and `lora/`, committed last, vouches for both."""
    from stages.train.current import up_to_date

    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    out, cfg = tmp_path / "run", cfg_of(max_steps=2, checkpoint_every=2, ema_decay=0.9)
    saved, real = [], train_saving._save_final_lora

    def killed_after_the_first(r, folder):
        if saved:
            raise KeyboardInterrupt("killed between the two final LoRAs (test)")
        saved.append(folder)
        return real(r, folder)

    monkeypatch.setattr(train_saving, "_save_final_lora", killed_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, root, tiny_edit_model, out)
    monkeypatch.undo()
    assert not up_to_date(cfg, root, tiny_edit_model, out)
    run(cfg, root, tiny_edit_model, out, resume=True, skip_if_done=True)
    assert (out / "lora").is_dir() and (out / "lora_ema").is_dir()
    assert up_to_date(cfg, root, tiny_edit_model, out)


def test_a_damaged_final_lora_is_not_up_to_date_and_the_rerun_writes_it_again(tmp_path, tiny_edit_model, capsys):
    """RUN/lora is what users load (predict, merge, export). A bit flipped there after training used to leave the
    run "up to date" (the check read only the last checkpoint's record): `run all` passed the damage on. Now the
    file is checked against its sealed checksums.json, the line names it, and the resume from the last checkpoint
    writes the same bytes again."""
    from stages.train.current import up_to_date

    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    out, cfg = tmp_path / "run", cfg_of(max_steps=2, checkpoint_every=2)
    run(cfg, root, tiny_edit_model, out)
    weights = out / "lora" / "pytorch_lora_weights.safetensors"
    clean = flip_bit(weights, weights.stat().st_size - 8, 2)
    assert not up_to_date(cfg, root, tiny_edit_model, out)
    assert f"{weights.name} is damaged" in capsys.readouterr().out
    run(cfg, root, tiny_edit_model, out, resume=True, skip_if_done=True)
    assert weights.read_bytes() == clean
    assert up_to_date(cfg, root, tiny_edit_model, out)


def test_the_main_rank_alone_reads_the_final_lora_and_every_rank_takes_its_answer(tmp_path, tiny_edit_model,
                                                                                     monkeypatch, capsys):
    """The up-to-date check reads the whole final LoRA and the last checkpoint's files (LoRA, optimizer state:
    their CRCs against checksums.json and resume.json). Every rank ran it: with 64 ranks each file was read 64
    times from the shared run folder at every `run all` start. Now the main rank alone reads them; the ranks'
    agreement (`all_max` of "not done", as for every other look) carries its answer, so a damaged LoRA is not up
    to date on any rank. Two ranks here, their collectives played in one process."""
    from contextlib import nullcontext

    import models.collective
    from stages.train import current, recipe
    from store import checksum

    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    out, cfg = tmp_path / "run", cfg_of(max_steps=2, checkpoint_every=2)
    run(cfg, root, tiny_edit_model, out)
    weights = out / "lora" / "pytorch_lora_weights.safetensors"
    read, crc = [], checksum.file_crc
    monkeypatch.setattr(checksum, "file_crc", lambda p: (read.append(Path(p)), crc(p))[1])
    answers = []  # each rank's "not done", which the all-reduce takes the maximum of
    monkeypatch.setattr(models.collective, "all_max", lambda world, values: answers.append(values[0]) or values)
    monkeypatch.setattr(recipe, "together", lambda world, what="": nullcontext())
    monkeypatch.setattr(recipe, "resolved_train", lambda c, world=1: current.resolved_train(c))
    backend = recipe.run_backend
    monkeypatch.setattr(recipe, "run_backend", lambda train, model, device, world=1: backend(train, model, device))

    def ranks_done() -> bool:
        answers.clear()
        for main in (True, False):
            read.clear()
            recipe.finished_here(cfg, root, tiny_edit_model, out, 2, main)
            assert (weights in read and len(read) > 1) if main else not read  # rank 1 takes no file's CRC
        return not max(answers)

    assert ranks_done()
    flip_bit(weights, weights.stat().st_size - 8, 2)
    capsys.readouterr()
    assert not ranks_done()  # rank 0 found it damaged: no rank skips training
    said = capsys.readouterr().out
    assert said.count(f"{weights.name} is damaged") == 1 and f"the run in {out} is not up to date" in said


def test_a_run_that_skipped_damaged_samples_is_current_under_skip_only(damaged_store, tiny_edit_model, tmp_path):
    """on_damaged is in no hash (a resume may switch it), but a finished run that left a damaged sample out was
    trained on fewer samples: under "stop" `run all` used to reuse it as up to date; now it is stale there (the
    rerun stops naming the sample), and stays current under "skip"."""
    from stages.train.current import up_to_date

    root, key = damaged_store
    out = tmp_path / "run"
    skip = cfg_of(max_steps=4, checkpoint_every=4, on_damaged="skip", max_damaged_fraction=0.2)
    run(skip, root, tiny_edit_model, out)
    assert list(damaged_log.read(out)) == [key]
    assert up_to_date(skip, root, tiny_edit_model, out)
    stop = cfg_of(max_steps=4, checkpoint_every=4)
    assert not up_to_date(stop, root, tiny_edit_model, out)
    # a resume under "stop" would carry the steps that left it out into a run of "stop": refused, naming why
    with pytest.raises(train_state.ResumeMismatch, match="train.on_damaged skip"):
        run(stop, root, tiny_edit_model, out, resume=True)
    # `run all` keeps the run aside and trains afresh, which stops at the damaged sample
    with pytest.raises(UserError, match=key):
        run(stop, root, tiny_edit_model, out, resume=True, skip_if_done=True, new_run=True)


def test_a_run_that_skipped_nonfinite_steps_is_current_under_skip_step_only(tmp_path, tiny_edit_model):
    """on_nonfinite is in no hash, but a finished run that skipped a step (no update) is not the run "stop" makes
    (that stops at the step): `run all` used to reuse it as up to date. Now its checkpoints record the skipped
    steps, every start's: stale and not resumable under "stop", current under skip_step."""
    from stages.train.current import up_to_date

    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4), poison={2: float("inf")})
    out = tmp_path / "run"
    skip = cfg_of(max_steps=4, checkpoint_every=2, on_nonfinite="skip_step")
    run(skip.model_copy(update={"train": skip.train.model_copy(update={"max_steps": 2})}), root, tiny_edit_model, out)
    first = train_state.nonfinite_skipped(ResumeRecord.read(out / "checkpoints" / "step-2" / train_state.RESUME_JSON))
    result = run(skip, root, tiny_edit_model, out, resume=True)  # the record carries the first start's steps
    record = ResumeRecord.read(train_state.latest_checkpoint(out / "checkpoints") / train_state.RESUME_JSON)
    skipped = train_state.nonfinite_skipped(record)
    assert skipped and skipped == sorted(set(first) | set(result.skipped_steps))
    assert up_to_date(skip, root, tiny_edit_model, out)
    stop = cfg_of(max_steps=4, checkpoint_every=2)
    assert not up_to_date(stop, root, tiny_edit_model, out)
    with pytest.raises(train_state.ResumeMismatch, match="train.on_nonfinite skip_step"):
        run(stop, root, tiny_edit_model, out, resume=True)
    with pytest.raises(train_guard.NonFiniteError):  # `run all`: kept aside, trained afresh, stopped at the step
        run(stop, root, tiny_edit_model, out, resume=True, skip_if_done=True, new_run=True)


def test_a_fresh_start_does_not_inherit_a_killed_starts_damaged_list(damaged_store, tiny_edit_model, tmp_path):
    """A start under on_damaged skip that stopped before its first checkpoint listed a damaged sample; the fresh
    start into the same folder (under "stop", on an intact store) left nothing out. Its list begins empty, as its
    validation curve does: before, the killed start's list stayed and made the finished run stale under "stop"
    (`run all` kept it aside and trained it again) and its resume refused."""
    from stages.train.current import up_to_date

    root, key = damaged_store
    out = tmp_path / "run"
    with pytest.raises(UserError, match="max_damaged_fraction"):  # stopped before any checkpoint
        run(cfg_of(max_steps=4, checkpoint_every=4, on_damaged="skip", max_damaged_fraction=0.1), root,
            tiny_edit_model, out)
    assert list(damaged_log.read(out)) == [key] and not train_state.latest_checkpoint(out / "checkpoints")
    intact = tmp_path / "intact"
    make_train_store(intact, tiny_edit_model, mixed_specs(8))
    stop = cfg_of(max_steps=4, checkpoint_every=2)
    run(stop.model_copy(update={"train": stop.train.model_copy(update={"max_steps": 2})}), intact, tiny_edit_model,
        out)
    assert damaged_log.read(out) == {}
    assert run(stop, intact, tiny_edit_model, out, resume=True).steps == 4  # not refused
    assert up_to_date(stop, intact, tiny_edit_model, out)


def test_the_damaged_list_of_a_run_holds_only_the_samples_its_steps_left_out(tmp_path, tiny_edit_model):
    """The sample met (damaged) at optimizer step 4 is left out of no step up to 3: a run ending at step 3 - taken
    from a longer run's checkpoint (a lower max_steps, `shorter`), or resumed from a checkpoint at 3 after a start
    that went past it and was killed - lists none, and is current under train.on_damaged stop, as the straight run
    to step 3 is. Before, the list was the longer start's whole: the run counted as leaving a sample out, so under
    stop `run all` refused it and trained it again from step 0."""
    from stages.train.current import up_to_date

    root = tmp_path / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(8))
    key = key_at(root, "vae", 1)  # batch 2, seed 0: in the 4th step of epoch 0 (the 2nd of epoch 1 is step 6)
    flip_bit(*sample_byte(root, "vae", key, "target"), 6)
    skip = dict(on_damaged="skip", max_damaged_fraction=0.2, keep_checkpoints=5)
    longer = run(cfg_of(max_steps=4, checkpoint_every=1, **skip), root, tiny_edit_model, tmp_path / "a")
    assert longer.steps == 4 and list(damaged_log.read(tmp_path / "a")) == [key]  # met at step 4
    # a lower max_steps under a constant LR (`run all`): the kept run's checkpoint step-3 is this run's LoRA
    shorter = run(cfg_of(max_steps=3, checkpoint_every=1, **skip), root, tiny_edit_model, tmp_path / "a",
                  resume=True, new_run=True, skip_if_done=True)
    assert shorter.start_step == 3 and shorter.steps == 3
    assert damaged_log.read(tmp_path / "a") == {}
    assert up_to_date(cfg_of(max_steps=3, checkpoint_every=1, on_damaged="stop"), root, tiny_edit_model,
                      tmp_path / "a")
    # a start killed after step 4 (its list written, its checkpoint not), resumed to max_steps 3
    run(cfg_of(max_steps=4, checkpoint_every=3, **skip), root, tiny_edit_model, tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-4")
    shutil.rmtree(tmp_path / "b" / "lora")
    resumed = run(cfg_of(max_steps=3, checkpoint_every=3, **skip), root, tiny_edit_model, tmp_path / "b",
                  resume=True)
    assert resumed.steps == 3
    stop = cfg_of(max_steps=3, checkpoint_every=3, on_damaged="stop")
    assert up_to_date(stop, root, tiny_edit_model, tmp_path / "b")
    again = run(stop, root, tiny_edit_model, tmp_path / "b", resume=True, new_run=True, skip_if_done=True)
    assert again.up_to_date and again.kept_previous is None
