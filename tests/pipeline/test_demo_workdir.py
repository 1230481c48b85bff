"""`pipeline demo --workdir DIR` writes only into a new/empty folder or a previous demo workdir."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.demo_workdir import MARKER, claim_workdir
from schemas.errors import UserError


def test_demo_refuses_a_folder_with_other_files(tmp_path):
    data = tmp_path / "my-dataset"
    (data / "target").mkdir(parents=True)
    (data / "target" / "a.png").write_bytes(b"not ours")
    res = CliRunner().invoke(app, ["demo", "--workdir", str(data)])
    assert res.exit_code == 2  # a mistake on the command line (README), found before any work; it was 1
    assert res.output.count("\n") == 1
    assert f"--workdir {data} is not empty and is not a previous demo workdir" in res.output
    assert f"--workdir {data / 'demo-workdir'}" in res.output  # says what to do
    assert sorted(p.name for p in data.iterdir()) == ["target"]  # nothing written (no config.yaml, no marker)
    file = tmp_path / "notes.txt"
    file.write_text("x")
    res = CliRunner().invoke(app, ["demo", "--workdir", str(file)])
    assert res.exit_code == 2 and f"--workdir {file} is a file: pass a new or empty folder" in res.output
    with pytest.raises(UserError, match="is a file"):
        claim_workdir(file)
    # under a file: refused as a mistake on the command line too (it failed at mkdir, exit 1)
    res = CliRunner().invoke(app, ["demo", "--workdir", str(file / "demo")])
    assert res.exit_code == 2 and f"--workdir {file / 'demo'} lies under {file}, which is a file" in res.output


def test_new_empty_and_previous_demo_workdirs_are_accepted(tmp_path):
    new = tmp_path / "a" / "b"
    claim_workdir(new)  # created and marked
    assert (new / MARKER).is_file()
    (new / "store").mkdir()
    claim_workdir(new)  # a rerun into the demo's own workdir
    empty = tmp_path / "empty"
    empty.mkdir()
    claim_workdir(empty)
    # a workdir written before the marker existed: its config.yaml points at DIR/store
    legacy = tmp_path / "legacy"
    (legacy / "store").mkdir(parents=True)
    (legacy / "config.yaml").write_text(f"paths:\n  store: {legacy / 'store'}\n")
    claim_workdir(legacy)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.yaml").write_text("paths:\n  store: /somewhere/else\n")
    with pytest.raises(UserError, match="not a previous demo workdir"):
        claim_workdir(other)


def test_a_demo_killed_right_after_its_data_gets_its_broken_sample_on_the_rerun(tmp_path, monkeypatch):
    """The corrupt file was added only together with the data: a kill between the two left a dataset without it,
    and the rerun (data there: not rebuilt) showed no quarantine."""
    from pipeline.commands import demo
    from pipeline.demo_data import make_demo_data

    monkeypatch.setattr(demo, "DEMO_SAMPLES", 3)
    data = tmp_path / "data"
    make_demo_data(data, n=3, fmt="folder", max_controls=1, seed=0, with_masks=True)  # ... then killed
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_index.json").write_text("{}")  # built earlier
    demo.prepare_inputs(tmp_path / "model", data, max_controls=1)
    broken = data / "target" / f"{demo.BROKEN_STEM}.png"
    assert broken.is_file() and (data / "target" / f"{demo.BROKEN_STEM}.txt").is_file()
    before = sorted(p.name for p in (data / "target").iterdir())
    demo.prepare_inputs(tmp_path / "model", data, max_controls=1)  # a rerun adds nothing
    assert sorted(p.name for p in (data / "target").iterdir()) == before


def test_a_demo_rerun_keeps_a_config_yaml_edited_since(tmp_path, monkeypatch):
    """The summary invites editing DIR/config.yaml; a later `pipeline demo` into DIR wrote its own settings over
    it, the edits gone without a word. Now the edited file is kept as DIR/config.previous.yaml (a later edit as
    config.previous.2.yaml, ...) and named; an unedited one is rewritten as it was, nothing kept."""
    import pipeline.orchestrate
    from pipeline.commands import demo

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop  # the stages are not this test's: the config is written before they run

    monkeypatch.setattr(demo, "prepare_inputs", lambda *a, **k: None)
    monkeypatch.setattr(pipeline.orchestrate, "run_all", stop)
    workdir = tmp_path / "w"
    CliRunner().invoke(app, ["demo", "--workdir", str(workdir)])
    config = workdir / "config.yaml"
    written = config.read_text()
    assert "max_steps: 60" in written
    res = CliRunner().invoke(app, ["demo", "--workdir", str(workdir)])  # unedited: nothing kept, nothing said
    assert isinstance(res.exception, Stop) and not (workdir / "config.previous.yaml").exists()
    assert "config.previous.yaml" not in res.output
    config.write_text(written.replace("max_steps: 60", "max_steps: 600"))  # the user's edit
    res = CliRunner().invoke(app, ["demo", "--workdir", str(workdir)])
    assert isinstance(res.exception, Stop)
    assert (workdir / "config.previous.yaml").read_text() == written.replace("max_steps: 60", "max_steps: 600")
    assert config.read_text() == written
    assert f"kept as {workdir / 'config.previous.yaml'}" in res.output
    # a second edit, another rerun: kept beside the first, which it wrote over before (the first edits lost)
    config.write_text(written.replace("max_steps: 60", "max_steps: 900"))
    res = CliRunner().invoke(app, ["demo", "--workdir", str(workdir)])
    assert isinstance(res.exception, Stop) and f"kept as {workdir / 'config.previous.2.yaml'}" in res.output
    assert (workdir / "config.previous.yaml").read_text() == written.replace("max_steps: 60", "max_steps: 600")
    assert (workdir / "config.previous.2.yaml").read_text() == written.replace("max_steps: 60", "max_steps: 900")
    # the first edit made again: named where it is kept already, no third copy
    config.write_text(written.replace("max_steps: 60", "max_steps: 600"))
    res = CliRunner().invoke(app, ["demo", "--workdir", str(workdir)])
    assert f"kept as {workdir / 'config.previous.yaml'}" in res.output
    assert sorted(p.name for p in workdir.glob("config*")) == ["config.previous.2.yaml", "config.previous.yaml",
                                                               "config.yaml"]


def test_the_demo_names_its_first_step_before_that_step_prints(tmp_path, monkeypatch, capsys):
    """The tiny model's write draws a bar ("Writing model shards"); the demo's `== make-tiny-model` header came
    after it, so its first lines showed a bar under no header, above the header of a step that had finished."""
    import pipeline.commands.tools as tools
    from pipeline.commands import demo

    monkeypatch.setattr(tools, "write_tiny_model", lambda *a, **k: print("the model's write"))
    data = tmp_path / "data"
    (data / "target").mkdir(parents=True)
    (data / "target" / f"{demo.BROKEN_STEM}.txt").write_text("x")  # data there: only the model is built
    demo.prepare_inputs(tmp_path / "model", data, max_controls=1)
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["== make-tiny-model", "the model's write"], out
