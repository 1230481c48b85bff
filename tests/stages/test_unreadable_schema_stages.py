"""A table version whose schema.json does not read (a crash left it empty or short, a bit flipped) and that no
`store verify` has marked: each stage that writes the table treats it as a marked version (a new version where the
stage would write one) or refuses in one line naming the file and a command that gets out - never a loop of
"rerun the stage" that stops at the same place (before: `find_version` raised for every run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from damage import flip_bit
from pipeline.cli import app
from pipeline.demo_data import make_demo_data
from store import Store
from store import format as fmt

SMALL = ["--set", "resize.target_area=4096", "--set", "resize.control_vae_area=4096", "--set",
         "resize.control_vl_area=1024", "--set", "resize.min_side=16", "--set", "resize.max_controls=2"]
OTHER = ["--set", "resize.target_area=8192"]  # another lineage: another version


def cli(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in r.output, r.output
    return r


def damage(path: Path, how: str) -> None:
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    else:
        flip_bit(path, 40, 2)


@pytest.fixture
def source(tmp_path) -> Path:
    make_demo_data(tmp_path / "src", n=6, fmt="folder", max_controls=2, seed=1)
    return tmp_path / "src"


def resize(source: Path, store: Path, *extra: str):
    return cli("run", "resize-bucket", "--source", source, "--store", store, *SMALL, *extra)


@pytest.mark.parametrize("how", ["empty", "truncated", "flipped"])
def test_an_unreadable_older_images_version_does_not_stop_resize_bucket(source, tmp_path, how):
    """Before: every run stopped in `find_version` at v1's schema.json, whatever its settings."""
    store = tmp_path / "store"
    assert resize(source, store).exit_code == 0
    assert resize(source, store, *OTHER).exit_code == 0  # v2, current
    damage(store / "images" / "v1" / fmt.SCHEMA_JSON, how)
    r = resize(source, store, *OTHER)
    assert r.exit_code == 0 and "images v2 is up to date" in r.output, r.output
    r = resize(source, store)  # v1's settings: v1 is treated as damaged, a new version written
    assert r.exit_code == 0, r.output
    st = Store(store)
    assert st.tables()["images"] == 3 and len(st.reader("images")) == 6
    assert fmt.damaged_marker(store, "images", 1).is_file()


def _rerun_refused_with(source, store, name: str) -> str:
    """resize-bucket into `store`, its images v1's `name` emptied, resize-bucket again: refused in one error line
    naming the file. That line."""
    assert resize(source, store).exit_code == 0
    (store / "images" / "v1" / name).write_bytes(b"")
    r = resize(source, store)
    error = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 1 and len(error) == 1 and name in error[0], r.output
    return error[0]


def test_an_unreadable_current_images_schema_names_a_command_that_gets_out(source, tmp_path):
    """The current version's schema.json holds the split rule a rerun keeps: refused in one line naming the file
    and `--set resize.split_by`; that command then runs (before: it stopped in `find_version`, the same file), and
    so does the plain stage after it."""
    store = tmp_path / "store"
    error = _rerun_refused_with(source, store, fmt.SCHEMA_JSON)
    assert str(store / "images" / "v1" / fmt.SCHEMA_JSON) in error, error
    assert "--set resize.split_by=pictures or =key" in error
    r = resize(source, store, "--set", "resize.split_by=pictures")
    assert r.exit_code == 0, r.output
    assert Store(store).tables()["images"] == 2
    r = resize(source, store)
    assert r.exit_code == 0 and "images v2 is up to date" in r.output, r.output
    assert cli("store", "verify", store).exit_code == 0


@pytest.mark.parametrize("table", ["text", "vae"])
def test_an_encode_stage_rerun_writes_a_new_version_past_an_unreadable_schema(edit_store, tiny_edit_model, tmp_path,
                                                                             table):
    """Nothing read the version (no training, no verify) before the stage's own rerun: before, that rerun stopped
    with "schema.json is not valid JSON" and no advice; now it writes a new version and training reads it."""
    model = ["--model", tiny_edit_model, "--device", "cpu"]
    for stage in ("encode-text", "encode-vae"):
        assert cli("run", stage, "--store", edit_store, *model).exit_code == 0
    (edit_store / table / "v1" / fmt.SCHEMA_JSON).write_bytes(b"")
    r = cli("run", f"encode-{table}", "--store", edit_store, *model)
    assert r.exit_code == 0, r.output
    assert Store(edit_store).tables()[table] == 2
    r = cli("run", "train", "--store", edit_store, *model, "--out", tmp_path / "run", "--max-steps", "1",
            "--batch-size", "2")
    assert r.exit_code == 0, r.output


def test_a_damaged_current_checksums_json_names_the_split_rule_command_that_gets_out(source, tmp_path):
    """checksums.json is what shows schema.json intact: damaged, the split rule cannot be trusted either (before:
    the rerun it named took the rule from schema.json unchecked). The command named runs, then the plain stage."""
    store = tmp_path / "store"
    error = _rerun_refused_with(source, store, fmt.CHECKSUMS)
    assert "--set resize.split_by=pictures or =key" in error
    assert resize(source, store, "--set", "resize.split_by=pictures").exit_code == 0
    r = resize(source, store)
    assert r.exit_code == 0 and "images v2 is up to date" in r.output, r.output


def test_a_damaged_images_manifest_names_store_repair_which_gets_out(source, tmp_path):
    """A manifest (schema.json intact) is refused naming `store repair`, which rebuilds it from the shard indexes;
    the stage then runs."""
    store = tmp_path / "store"
    error = _rerun_refused_with(source, store, fmt.MANIFEST)
    assert f"run `pipeline store repair {store}`" in error
    assert cli("store", "repair", store).exit_code == 0
    r = resize(source, store)
    assert r.exit_code == 0 and "images v2 is up to date" in r.output, r.output


def test_train_refuses_an_unreadable_schema_naming_the_encode_rerun_which_gets_out(edit_store, tiny_edit_model,
                                                                                  tmp_path):
    """Train (and evaluate: the same reader) refuses the current version in one line naming its schema.json and
    the encode stage's rerun; that rerun writes a new version and training then runs."""
    model = ["--model", tiny_edit_model, "--device", "cpu"]
    for stage in ("encode-text", "encode-vae"):
        assert cli("run", stage, "--store", edit_store, *model).exit_code == 0
    flip_bit(edit_store / "vae" / "v1" / fmt.SCHEMA_JSON, 40, 2)
    train = ["run", "train", "--store", edit_store, *model, "--max-steps", "1", "--batch-size", "2"]
    r = cli(*train, "--out", tmp_path / "a")
    error = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 1 and len(error) == 1 and f"vae/v1): {fmt.SCHEMA_JSON} is damaged" in error[0], r.output
    assert "rerun `pipeline run encode-vae`" in error[0]
    assert cli("run", "encode-vae", "--store", edit_store, *model).exit_code == 0
    r = cli(*train, "--out", tmp_path / "b")
    assert r.exit_code == 0, r.output
