"""`pipeline run train --out DIR` into a non-empty folder that holds no run (a dataset, a report folder): train
wrote its lora/, checkpoints/ and logs/ in among the user's files. Now refused before anything is loaded or
written; a new, empty or earlier run folder is taken as before."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.run_folder import refuse_a_folder_of_other_files
from schemas.errors import UserError


def test_a_folder_of_other_files_is_refused_untouched(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    for name in ("index.html", "metrics.json", "losses.zarr"):  # an evaluate report passed as --out by mistake
        (out / name).write_text("{}")
    r = CliRunner().invoke(app, ["run", "train", "--store", str(tmp_path / "store"), "--model", "m", "--out", str(out)])
    assert r.exit_code == 1, r.output
    assert r.output.startswith(f"error: --out {out} holds other files (index.html, losses.zarr, metrics.json) and "
                               "no training run"), r.output
    assert sorted(f.name for f in out.iterdir()) == ["index.html", "losses.zarr", "metrics.json"]


def test_new_empty_and_run_folders_pass(tmp_path):
    refuse_a_folder_of_other_files(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    refuse_a_folder_of_other_files(tmp_path / "empty")
    killed = tmp_path / "killed"  # a run killed right after it started: its lock file only
    killed.mkdir()
    (killed / ".train.lock").write_text("")
    refuse_a_folder_of_other_files(killed)
    shown = tmp_path / "shown"  # a new folder opened in Finder: its litter only (was "holds other files")
    shown.mkdir()
    (shown / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (shown / "._.DS_Store").write_bytes(b"")
    refuse_a_folder_of_other_files(shown)
    (shown / "notes.txt").write_text("mine")  # litter beside a user's file: refused, naming the file only
    with pytest.raises(UserError, match=r"holds other files \(notes\.txt\) and no training run"):
        refuse_a_folder_of_other_files(shown)
    repo = tmp_path / "repo"  # a hidden folder is a user's (a git repo, a venv), not litter: a keep would move it
    (repo / ".git").mkdir(parents=True)
    (repo / ".DS_Store").write_bytes(b"")
    with pytest.raises(UserError, match=r"holds other files \(\.git\) and no training run"):
        refuse_a_folder_of_other_files(repo)


def test_run_all_refuses_such_a_paths_run_before_its_first_stage(tmp_path):
    import yaml

    data = tmp_path / "mydata"
    data.mkdir()
    (data / "notes.txt").write_text("mine")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"source": str(tmp_path / "src"), "store": str(tmp_path / "store"),
                                                "model": "m", "run": str(data), "report": str(tmp_path / "rep")}}))
    r = CliRunner().invoke(app, ["run", "all", "--config", str(config)])
    assert r.exit_code == 2 and r.output.startswith(f"error: paths.run {data} holds other files (notes.txt)"), r.output
    assert not (tmp_path / "store").exists()


def test_run_all_refuses_a_paths_report_of_other_files_before_its_first_stage(tmp_path):
    """evaluate refuses a report folder holding other files (`stages.evaluate.report_folder.check_report_folder`); `run all`
    found that only when evaluate started, after resize-bucket, both encoders and the whole training. Now the same
    check before its first stage."""
    import yaml

    report = tmp_path / "mydata"
    report.mkdir()
    (report / "notes.txt").write_text("mine")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"source": str(tmp_path / "src"), "store": str(tmp_path / "store"),
                                                "model": "m", "run": str(tmp_path / "run"), "report": str(report)}}))
    r = CliRunner().invoke(app, ["run", "all", "--config", str(config)])
    assert r.exit_code == 2 and r.output.startswith(f"error: paths.report {report} is not empty and holds no "
                                                    "earlier report"), r.output
    assert "== resize-bucket" not in r.output and not (tmp_path / "store").exists()
    assert sorted(p.name for p in report.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("where", ["is a file", "lies under"])
def test_run_all_refuses_a_file_at_paths_report_before_its_first_stage(tmp_path, where):
    """A file at paths.report (or on its path) passed `run all`'s check of it: only `pipeline run evaluate` looked
    for one, so evaluate failed after resize-bucket, both encoders and the whole training."""
    import yaml

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    report = notes if where == "is a file" else notes / "report"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"source": str(tmp_path / "src"), "store": str(tmp_path / "store"),
                                                "model": "m", "run": str(tmp_path / "run"), "report": str(report)}}))
    r = CliRunner().invoke(app, ["run", "all", "--config", str(config)])
    assert r.exit_code == 2 and r.output.startswith(f"error: paths.report {report} {where}"), r.output
    assert "== resize-bucket" not in r.output and not (tmp_path / "store").exists()
    assert notes.read_text() == "mine"


def test_run_all_names_an_output_folder_it_cannot_read_in_one_line(tmp_path, monkeypatch):
    """An output folder whose listing fails (a permission, a disk) is no usage mistake: one line, exit 1, as every
    error the work meets (its check runs under `usage_errors` for the refusals, exit 2; a traceback otherwise)."""
    import yaml

    import pipeline.run_folder as run_folder

    def unreadable(path, what):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(run_folder, "refuse_a_folder_of_other_files", unreadable)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"source": str(tmp_path / "src"), "store": str(tmp_path / "store"),
                                                "model": "m", "run": str(tmp_path / "run"),
                                                "report": str(tmp_path / "report")}}))
    r = CliRunner().invoke(app, ["run", "all", "--config", str(config)])
    assert r.exit_code == 1 and "Traceback" not in r.output, (r.exit_code, r.output, r.exception)
    assert r.output.count("error:") == 1 and str(tmp_path / "run") in r.output, r.output


def test_a_report_folder_left_by_an_interrupted_report_passes(tmp_path):
    """What either evaluate leaves when stopped before metrics.json (written last) is written over by the rerun:
    the one check of both (evaluate --all-checkpoints refused its own grid.png / index.html / temp files)."""
    from stages.evaluate.report_folder import check_report_folder

    out = tmp_path / "report"
    (out / "losses.zarr").mkdir(parents=True)
    for name in ("grid.png", "index.html", ".index.html.tmp-4242", ".evaluate.lock"):
        (out / name).write_text("")
    check_report_folder(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is not empty and holds no earlier report"):
        check_report_folder(out)
    (out / "metrics.json").write_text("{}")  # an earlier report, whatever else it holds
    check_report_folder(out)


def test_run_all_refuses_a_store_inside_paths_run_on_its_first_invocation_too(tmp_path):
    """A store inside paths.run: the first `run all` went on (paths.run absent), one killed before train left
    paths.run holding the store only, and the rerun was refused as 'holds other files (store) and no training
    run' (the user's own store); a keep would have moved the store along. Now one line on every invocation."""
    import yaml

    run, store = tmp_path / "run", tmp_path / "run" / "store"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"paths": {"source": str(tmp_path / "src"), "store": str(store), "model": "m",
                                                "run": str(run), "report": str(run / "report")}}))
    line = (f"error: paths.store {store} is inside paths.run {run}: a run on other inputs is kept by renaming "
            f"paths.run to {tmp_path / 'run.previous'}/N-TIME")
    for killed_before_train in (False, True):
        if killed_before_train:
            store.mkdir(parents=True)  # what resize-bucket and the encoders left
            (store / "store.json").write_text("{}")
        r = CliRunner().invoke(app, ["run", "all", "--config", str(config)])
        assert r.exit_code == 2 and r.output.startswith(line), r.output
    assert sorted(p.name for p in run.iterdir()) == ["store"]


def test_a_hub_model_named_like_a_folder_in_paths_run_is_not_inside_it(tmp_path):
    """A model that is no folder here is a hub id (models/loading.py), whatever paths.run is called; the report
    is not checked (it may sit inside paths.run: a kept run takes its report along, `orchestrate._report_into`)."""
    from pipeline.run_folder import refuse_inputs_inside

    run = tmp_path / "Qwen"
    refuse_inputs_inside(run, {"paths.store": str(tmp_path / "store"), "paths.source": str(tmp_path / "src"),
                               "paths.model": str(run / "Qwen-Image-Edit-2509")})


def test_a_start_that_fails_before_writing_leaves_no_run_folder(tmp_path, tiny_edit_model):
    """A `run train` stopped by a bad input (here: a store without tables) before it wrote anything left --out
    behind, empty but for its lock: it looked like a run folder. What the failed start made goes (the lock file,
    --out and the parent it made); what was there before stays (a user's empty folder, an earlier killed start's
    lock)."""
    from store import Store

    store = tmp_path / "store"
    Store(store)  # no tables: refused when train opens them, after the run folder's lock

    def train(out):
        r = CliRunner().invoke(app, ["run", "train", "--store", str(store), "--model", tiny_edit_model,
                                     "--out", str(out), "--device", "cpu"])
        assert r.exit_code == 1 and "has no 'text' table" in r.output, r.output

    train(tmp_path / "runs" / "exp1")
    assert not (tmp_path / "runs").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    train(empty)
    assert empty.is_dir() and not list(empty.iterdir())
    killed = tmp_path / "killed"  # an earlier start killed right after it took the lock
    killed.mkdir()
    (killed / ".train.lock").write_text("pid 1 on elsewhere")
    train(killed)
    assert [p.name for p in killed.iterdir()] == [".train.lock"]


@pytest.mark.parametrize("made", [True, False], ids=["out-made-by-the-failed-start", "users-empty-out"])
def test_a_start_racing_a_failed_starts_cleanup_still_excludes_a_third(tmp_path, monkeypatch, made):
    """A failed start's release unlinks its lock file (and an --out it made). A second start that opened that file
    just before and took the flock just after held a lock on a file no longer there (in a folder removed): a
    third start then locked a new file, and two trainings wrote one --out."""
    import fcntl

    from stages.train.guard import RunDirLock

    out = tmp_path / "out"
    if not made:
        out.mkdir()
    failed = RunDirLock(out)  # a start that fails before writing anything
    real = fcntl.flock

    def lock_after_the_release(fd, op):  # the second start: its file opened, its flock not yet taken
        monkeypatch.setattr(fcntl, "flock", real)
        failed.release()
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", lock_after_the_release)
    second = RunDirLock(out)
    assert (out / ".train.lock").exists()
    with pytest.raises(UserError, match="is being written by"):
        RunDirLock(out)  # a third start into the same --out
    second.release()


def test_a_start_refused_as_the_holder_lets_go_takes_the_folder(tmp_path, monkeypatch):
    """A second start refused by the flock while the failed start still held it read the holder's name from a
    lock file that start's release had unlinked just then: a FileNotFoundError traceback, no line."""
    import fcntl

    from stages.train.guard import RunDirLock

    out = tmp_path / "out"
    failed = RunDirLock(out)
    real = fcntl.flock

    def refused_then_released(fd, op):
        monkeypatch.setattr(fcntl, "flock", real)
        try:
            return real(fd, op)
        finally:
            failed.release()

    monkeypatch.setattr(fcntl, "flock", refused_then_released)
    second = RunDirLock(out)  # the folder is free: taken
    with pytest.raises(UserError, match="is being written by"):
        RunDirLock(out)
    second.release()
