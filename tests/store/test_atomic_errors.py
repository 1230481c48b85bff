"""An atomic write that fails names the path the user gave (`--out`, a folder to write), not the hidden temp path
it was writing (`.NAME.tmp-PID`, removed by the time the line is read); the temp path stays in the detail."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from store.format import atomic_dir, atomic_write_bytes


def test_a_folder_that_cannot_be_made_is_named_as_given(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    final = tmp_path / "file" / "out"
    with pytest.raises(NotADirectoryError) as e:
        with atomic_dir(final):
            pass
    assert e.value.filename == str(final) and ".out.tmp-" in e.value.strerror, e.value


def test_a_file_inside_the_temp_folder_is_named_under_the_final_one(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(FileNotFoundError) as e:
        with atomic_dir(final) as tmp:
            (tmp / "a" / "b.json").write_text("{}")  # its folder was never made
    assert e.value.filename == str(final / "a" / "b.json") and ".out.tmp-" in e.value.strerror, e.value
    assert not final.exists() and not list(tmp_path.iterdir())  # nothing left behind


def test_a_file_write_is_named_as_given(tmp_path):
    path = tmp_path / "missing" / "x.json"
    with pytest.raises(FileNotFoundError) as e:
        atomic_write_bytes(path, b"{}")
    assert e.value.filename == str(path) and ".x.json.tmp-" in e.value.strerror, e.value


def test_the_cli_line_names_the_users_folder(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    # refused before anything is written, a mistake on the command line (exit 2: pipeline/commands/tools.py)
    res = CliRunner().invoke(app, ["make-demo-data", str(tmp_path / "file" / "data"), "--n", "2"])
    assert res.exit_code == 2
    assert f"error: {tmp_path / 'file' / 'data'} lies under {tmp_path / 'file'}, which is a file" in res.output, \
        res.output
    assert ".tmp-" not in res.output, res.output
