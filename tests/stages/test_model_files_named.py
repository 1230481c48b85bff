"""A table records the files of the model that encoded it (`attrs.model_files`: path, size, sha256, by path
parts), so a table re-encoded or refused for another model names the files that differ (a few, then a count), not
only two fingerprints; from the same walk as the fingerprint (the file-hash cache: nothing read twice)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from models.model_files import MODEL_FILES_ATTR
from pipeline.config import load_config
from schemas import UserError
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from stages.train.data import open_inputs
from store import Store
from store.manifest_files import read_schema


def _why_new(out: str) -> str:
    [line] = [x for x in out.splitlines() if "is not this run's" in x]
    return line


def test_tables_record_the_model_files_and_name_those_that_differ(tiny_edit_model, edit_store, tmp_path, capsys):
    model = Path(shutil.copytree(tiny_edit_model, tmp_path / "model"))
    cfg = load_config(None)
    encode_text.run(cfg, edit_store, str(model))
    encode_vae.run(cfg, edit_store, str(model))
    st = Store(edit_store)
    record = read_schema(st.version_dir("text", 1)).attrs[MODEL_FILES_ATTR]
    files = sorted(p for p in model.rglob("*") if p.is_file())
    assert [r[0] for r in record] == [str(p.relative_to(model)) for p in files]  # every file, by path parts
    assert [r[1] for r in record] == [p.stat().st_size for p in files]
    assert read_schema(st.version_dir("vae", 1)).attrs[MODEL_FILES_ATTR] == record
    capsys.readouterr()

    # one file changed: train refuses the tables naming it, encode-text's new version names it
    (model / "tiny_model.json").write_text(json.dumps({"variant": "edit", "seed": 0, "note": "changed"}))
    with pytest.raises(UserError) as e:
        open_inputs(edit_store, str(model))
    assert "different model" in str(e.value) and "; files that differ: tiny_model.json (changed))" in str(e.value)
    encode_text.run(cfg, edit_store, str(model))
    why = _why_new(capsys.readouterr().out)
    assert "model fingerprint " in why and "; files that differ: tiny_model.json (changed)): writing" in why, why

    # many changed, one removed, one new: the first three by path parts, then a count
    for name in ("vae/config.json", "transformer/config.json", "text_encoder/config.json"):
        (model / name).write_text((model / name).read_text() + "\n")
    (model / "scheduler" / "scheduler_config.json").unlink()
    (model / "zz-notes.txt").write_text("new")
    with pytest.raises(UserError) as e:
        open_inputs(edit_store, str(model))  # text v2: the record of the second model
    assert ("; files that differ: scheduler/scheduler_config.json (not in --model), text_encoder/config.json "
            "(changed), transformer/config.json (changed) and 2 more)") in str(e.value), str(e.value)
