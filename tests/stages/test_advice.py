"""Advice that leads somewhere: each damage gets the command that actually fixes it, and following it works."""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from damage import flip_bit
from pipeline.cli import app


def _cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    return r


@pytest.fixture
def encoded(edit_store, tiny_edit_model):
    r = _cli("run", "encode-vae", "--store", edit_store, "--model", tiny_edit_model, "--device", "cpu")
    assert r.exit_code == 0, r.output
    return edit_store


def test_a_damaged_schema_json_says_rerun_the_stage_and_that_works(encoded, tiny_edit_model):
    flip_bit(encoded / "vae" / "v1" / "schema.json", 40, 2)
    assert _cli("store", "verify", encoded).exit_code == 1
    r = _cli("store", "repair", encoded, "--model", tiny_edit_model)
    assert r.exit_code == 1 and "rerun `pipeline run encode-vae`" in r.output
    assert "run `pipeline store repair" not in r.output  # no circle
    r = _cli("run", "encode-vae", "--store", encoded, "--model", tiny_edit_model, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert _cli("store", "verify", encoded).exit_code == 0


@pytest.mark.parametrize("name", ["rank-00.done", "shard-r00-000000.index.parquet"])
def test_a_damaged_derived_file_is_repaired_not_nothing_to_repair(encoded, tiny_edit_model, name):
    path = encoded / "vae" / "v1" / name
    flip_bit(path, path.stat().st_size // 2, 3)
    assert _cli("store", "verify", encoded).exit_code == 1
    r = _cli("store", "repair", encoded, "--model", tiny_edit_model)
    assert r.exit_code == 0 and "nothing to repair" not in r.output and name in r.output, r.output
    assert _cli("store", "verify", encoded).exit_code == 0


def test_an_incomplete_or_broken_model_folder_is_named_not_a_different_model(encoded, tiny_edit_model, tmp_path):
    missing = tmp_path / "missing"
    shutil.copytree(tiny_edit_model, missing)
    shutil.rmtree(missing / "vae")
    r = _cli("run", "encode-vae", "--store", encoded, "--model", missing, "--device", "cpu")
    assert r.exit_code == 1 and "incomplete" in r.output and "'vae'" in r.output and "different model" not in r.output
    broken = tmp_path / "broken"
    shutil.copytree(tiny_edit_model, broken)
    (broken / "transformer" / "config.json").write_text("{not json")
    r = _cli("run", "train", "--store", encoded, "--model", broken, "--out", tmp_path / "run", "--device", "cpu")
    assert r.exit_code == 1 and "transformer/config.json is not valid JSON" in r.output
    assert "different model" not in r.output


def test_the_nonfinite_stop_does_not_send_to_store_verify():
    from stages.train.guard import nonfinite_message

    msg = nonfinite_message(3, {"k1": float("nan"), "k2": 0.5}, "STORE")
    assert "k1" in msg and "run `pipeline store verify" not in msg and "re-encode" in msg
    assert "train.on_nonfinite=skip_step" in msg
