"""A new store only in a new or empty folder: `--store` naming the dataset, a run or a report folder made a store
there, its tables in among the user's files (resize-bucket, `run all`'s paths.store, `store pull`). Refused now
before anything is written; a new, empty or existing store folder is taken as before."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.demo_data import make_demo_data
from pipeline.run_folder import refuse_a_store_among_other_files
from schemas.errors import UserError


def _dataset(root):
    (root / "target").mkdir(parents=True)
    (root / "target" / "a.png").write_bytes(b"png")
    (root / "notes.txt").write_text("mine")
    return sorted(p.relative_to(root) for p in root.rglob("*"))


@pytest.mark.parametrize("args", [
    ["run", "resize-bucket", "--source", "{src}", "--store", "{dst}"],
    ["store", "pull", "{src}", "{dst}"],
], ids=lambda a: " ".join(a[:2]))
def test_a_folder_of_other_files_is_refused_untouched(tmp_path, args):
    dst = tmp_path / "data"
    before = _dataset(dst)
    src = tmp_path / "src"
    if args[0] == "run":  # a real source: before, resize-bucket wrote its store into dst
        make_demo_data(src, n=2)
    else:
        src.mkdir()
    r = CliRunner().invoke(app, [a.format(src=src, dst=dst) for a in args])
    assert r.exit_code == 1, r.output
    what = "--store" if args[0] == "run" else "STORE"
    assert r.output == (f"error: {what} {dst} holds other files (notes.txt, target) and no store (no store.json): "
                        "a new store's tables would go in among them; pass a new or empty folder, or the folder of "
                        "an existing store\n"), r.output
    assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == before


def test_run_all_refuses_a_store_path_of_other_files_before_any_stage(tmp_path):
    dst = tmp_path / "data"
    before = _dataset(dst)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"paths:\n  source: {tmp_path / 'src'}\n  store: {dst}\n  model: m\n  run: {tmp_path / 'run'}\n"
                   f"  report: {tmp_path / 'report'}\n")
    r = CliRunner().invoke(app, ["run", "all", "--config", str(cfg)])
    assert r.exit_code == 2, r.output
    assert r.output.startswith(f"error: paths.store {dst} holds other files"), r.output
    assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == before


def test_new_empty_and_store_folders_pass(tmp_path):
    refuse_a_store_among_other_files(tmp_path / "new")
    refuse_a_store_among_other_files("s3://bucket/prefix")
    (tmp_path / "empty").mkdir()
    refuse_a_store_among_other_files(tmp_path / "empty")
    store = tmp_path / "store"  # a store: its tables, or only the lock a first open takes before store.json
    (store / "images").mkdir(parents=True)
    (store / ".store.lock").write_text("")
    refuse_a_store_among_other_files(store)
    (store / "store.json").write_text("{}")
    refuse_a_store_among_other_files(store)
    (tmp_path / "litter").mkdir()
    (tmp_path / "litter" / ".DS_Store").write_bytes(b"")
    refuse_a_store_among_other_files(tmp_path / "litter")
    (tmp_path / "litter" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds other files"):
        refuse_a_store_among_other_files(tmp_path / "litter")
