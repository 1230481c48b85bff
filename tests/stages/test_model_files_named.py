"""A table records the files of the model that encoded it (`attrs.model_files`: path, size, sha256, by path
parts), so a table re-encoded or refused by train / evaluate for another model names the files that differ (a few,
then a count), not only two fingerprints; from the same walk as the fingerprint (the file-hash cache: nothing
read twice). A table encoded before they were recorded is refused as before, by the fingerprints alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from features.open import open_configured
from models.loading import model_files, model_fingerprint
from pipeline.config import load_config
from schemas import UserError
from schemas.config import EvaluateConfig, TrainConfig
from schemas.model_files import MODEL_FILES_ATTR
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from store import Store
from store.manifest_files import read_schema
from train_store import make_train_store, mixed_specs


def _why_new(out: str) -> str:
    [line] = [x for x in out.splitlines() if "is not this run's" in x]
    return line


def _refusal(store, model: str) -> str:
    """What train (its data) and evaluate (its section) say, the same line."""
    with pytest.raises(UserError) as train:
        open_configured(TrainConfig(), "train", store, model, model_files(model), "train")
    with pytest.raises(UserError) as evaluate:
        open_configured(EvaluateConfig(), "evaluate", store, model, model_files(model), "val")
    assert str(train.value) == str(evaluate.value)
    return str(train.value)


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

    # one file changed: train and evaluate refuse the tables naming it, encode-text's new version names it
    size = (model / "tiny_model.json").stat().st_size
    (model / "tiny_model.json").write_text(json.dumps({"variant": "edit", "seed": 0, "note": "changed"}))
    grown = (model / "tiny_model.json").stat().st_size
    said = _refusal(edit_store, str(model))
    assert "different model" in said and f"; files that differ: tiny_model.json: size {size} -> {grown}); use" in said
    encode_text.run(cfg, edit_store, str(model))
    why = _why_new(capsys.readouterr().out)
    assert "model fingerprint " in why and f"; files that differ: tiny_model.json: size {size} -> {grown}): writing" \
        in why, why

    # many changed, one removed, one new: the first three by path parts, then a count
    for name in ("vae/config.json", "transformer/config.json", "text_encoder/config.json"):
        (model / name).write_text((model / name).read_text() + "\n")
    (model / "scheduler" / "scheduler_config.json").unlink()
    (model / "zz-notes.txt").write_text("new")
    said = _refusal(edit_store, str(model))  # text v2: the record of the second model
    assert "; files that differ: scheduler/scheduler_config.json: not in --model, text_encoder/config.json: size " \
           in said and ", transformer/config.json: size " in said and " and 2 more); use the model" in said, said


def test_tables_that_record_no_files_are_refused_by_the_fingerprints_alone(tiny_edit_model, tmp_path):
    """Tables encoded before attrs.model_files: the line stays as it was (nothing to compare)."""
    make_train_store(tmp_path / "s", tiny_edit_model, mixed_specs(2, 1), fingerprint="0123456789abcdef")
    said = _refusal(tmp_path / "s", tiny_edit_model)
    assert (f"was built with a different model (fingerprint 0123456789abcdef) than --model {tiny_edit_model} "
            f"({model_fingerprint(tiny_edit_model)}); use the model") in said, said
