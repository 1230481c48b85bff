"""evaluate says when val samples it scores were training samples of the run (the split changed since it
trained): through the real CLI on the tiny model, a run trained on one split, the same samples re-split (some
train samples now val) and re-encoded (the encoders carry their features), then evaluated - the single LoRA and
--all-checkpoints. An unchanged split: no line; the run's training images version gone: the check not made, said."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from pipeline.cli import app
from store import Store
from store import format as fmt

runner = CliRunner()
EVAL = ["--device", "cpu", "--num-samples", "0", "--set", "evaluate.noise_seeds=[0]", "--set",
        "evaluate.timesteps=[0.5]"]


def invoke(*args) -> object:
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res


def encode(store: Path, model: str) -> None:
    for stage in ("encode-text", "encode-vae"):
        invoke("run", stage, "--store", store, "--model", model, "--device", "cpu")


def evaluate(store: Path, model: str, run: Path, out: Path, *extra) -> tuple[str, dict]:
    target = ["--run", run, "--all-checkpoints"] if extra else ["--lora", run / "lora"]
    res = invoke("run", "evaluate", "--store", store, "--model", model, *target, "--out", out, *EVAL)
    return res.output, json.loads((out / "metrics.json").read_text())["run"]["trained_val"]


def val_keys(store: Path) -> list[str]:
    r = Store(store).reader("images")
    return sorted(k for k, s in zip(r.keys(), r.manifest.column("split").to_pylist()) if s == "val")


def test_val_samples_the_run_trained_on_are_said_and_counted(tiny_edit_model, edit_store, images_fixture,
                                                             tmp_path):
    model, run = tiny_edit_model, tmp_path / "run"
    encode(edit_store, model)
    invoke("run", "train", "--store", edit_store, "--model", model, "--out", run, "--max-steps", "2",
           "--batch-size", "2", "--device", "cpu")
    before = val_keys(edit_store)  # sample 3 of 6

    # the split it trained on: checked, nothing said
    output, found = evaluate(edit_store, model, run, tmp_path / "same")
    assert "training samples of run" not in output
    assert found == {"run": str(run.resolve()), "checked": True, "trained_images": 1, "val_images": 1,
                     "val_samples": 1, "trained_on": 0, "same_key": 0}

    # the same samples re-split (as a changed resize.val_fraction does): samples 1 and 5 move from train to val
    images_fixture.write(edit_store, images_fixture.edit_samples(), tag="b", val=lambda i: i in (1, 3, 5))
    encode(edit_store, model)
    now = val_keys(edit_store)
    assert len(now) == 3 and set(before) < set(now)
    output, found = evaluate(edit_store, model, run, tmp_path / "resplit")
    line = [ln for ln in output.splitlines() if "training samples of run" in ln]
    assert len(line) == 1 and "2 of 3 val samples were training samples" in line[0]
    assert "images v1 vs v2" in line[0] and "retrain" in line[0]
    assert (found["trained_on"], found["val_samples"], found["trained_images"], found["val_images"]) == (2, 3, 1, 2)
    # atop the report page too, where its figures are read (not only in the Run record's JSON at its end)
    page = (tmp_path / "resplit" / "index.html").read_text()
    assert page.index("<p class='trained-val'>warning: evaluate: 2 of 3 val samples") < page.index("<h2>")
    assert "class='trained-val'" not in (tmp_path / "same" / "index.html").read_text()
    # an up-to-date rerun says it again: the same figures, not held out all the same (it printed nothing)
    written = (tmp_path / "resplit" / "metrics.json").read_bytes()
    output, again = evaluate(edit_store, model, run, tmp_path / "resplit")
    assert "is up to date" in output and (tmp_path / "resplit" / "metrics.json").read_bytes() == written
    assert [ln for ln in output.splitlines() if "training samples of run" in ln] == line and again == found

    # --all-checkpoints: the same count, once for the run's one training, in the report's JSON
    output, found = evaluate(edit_store, model, run, tmp_path / "ckpts", "all")
    assert sum("2 of 3 val samples were training samples" in ln for ln in output.splitlines()) == 1
    assert [(f["trained_on"], f["val_samples"]) for f in found] == [(2, 3)]
    assert "<p class='trained-val'>warning: evaluate: 2 of 3" in (tmp_path / "ckpts" / "index.html").read_text()
    output, _ = evaluate(edit_store, model, run, tmp_path / "ckpts", "all")
    assert "is up to date" in output
    assert sum("2 of 3 val samples were training samples" in ln for ln in output.splitlines()) == 1

    # the run's tables collected: the check cannot be made, said so (not silence, not "0")
    st = Store(edit_store)
    for table in ("text", "vae"):
        shutil.rmtree(fmt.version_dir(st.root, table, 1))
    output, found = evaluate(edit_store, model, run, tmp_path / "gone")
    assert "cannot tell whether val samples were training samples of run" in output
    assert found["checked"] is False and "no longer in the store" in found["why"]


def test_a_val_sample_with_a_train_samples_pictures_counts_as_trained_on():
    """By key, or by the same `source_hashes` (the pair under another caption); a row without hashes (null or
    empty) shares nothing; a val row of the old split is no training sample."""
    import pyarrow as pa

    from stages.evaluate.trained_val import trained_on

    hashes = pa.list_(pa.string())
    trained = pa.table({"key": ["a", "b", "c", "d"], "split": ["train", "train", "val", "train"],
                        "source_hashes": pa.array([["t1", "c1"], ["t2"], ["t3"], None], hashes)})
    now = pa.table({"key": ["a", "x", "y", "z", "w", "c"], "split": ["val"] * 6,
                    "source_hashes": pa.array([["t1", "c1"], ["t2"], ["t1", "c9"], [], None, ["t3"]], hashes)})
    keys = ["a", "x", "y", "z", "w", "c"]
    assert trained_on(trained, now, keys) == (2, 1)  # a by key, x by b's pictures; y shares a target only
    assert trained_on(trained, None, keys) == (1, 1)  # no manifest of the val samples: keys only
    assert trained_on(trained.drop(["source_hashes"]), now, keys) == (1, 1)
    assert trained_on(trained, now, []) == (0, 0)


def test_the_images_version_a_repair_set_aside_is_still_checked(edit_store, images_fixture, monkeypatch):
    """The run trained on images v1, which a repair (or a stage's rerun) then replaced and set aside as
    v1.damaged/: its manifest, checked, still holds the split the run trained on, so the check is made from it.
    Before, the check was lost with advice to run `store repair` (which had just run, and changed nothing). Once
    `store gc` removed it too: said to be no longer in the store, not advice to repair."""
    from stages.evaluate import trained_val

    images_fixture.write(edit_store, images_fixture.edit_samples(), tag="b", val=lambda i: i in (1, 3, 5))
    st = Store(edit_store)
    v1 = fmt.version_dir(st.root, "images", 1)
    v1.rename(v1.with_name("v1.damaged"))  # as store/repair.py `set_aside` moves it
    monkeypatch.setattr(trained_val, "run_record", lambda lora: (Path("run"), {"vae": "v1-0"}))
    monkeypatch.setattr(trained_val, "training_images", lambda st, tables: (1, None))
    keys = val_keys(edit_store)
    found = trained_val.check(st, "run/lora", keys, 2)
    assert found["checked"] is True and (found["trained_on"], found["val_samples"]) == (2, 3), found
    shutil.rmtree(v1.with_name("v1.damaged"))  # collected by `store gc`
    found = trained_val.check(st, "run/lora", keys, 2)
    assert found["checked"] is False and "images v1 it trained on is no longer in the store" in found["why"]
    assert "store repair" not in found["warning"]


def test_an_images_version_missing_from_a_store_urls_cache_is_not_said_collected(edit_store, monkeypatch):
    """A store URL's cache holds the versions read, not every one: an images version absent there may be at the
    URL, so the line says it is not in this node's copy, not that it was collected (nor to repair the store)."""
    from stages.evaluate import trained_val
    from store.remote_parts import SOURCE_URL

    st = Store(edit_store)
    (st.root / SOURCE_URL).write_text("s3://bucket/store")
    monkeypatch.setattr(trained_val, "run_record", lambda lora: (Path("run"), {"vae": "v1-0"}))
    monkeypatch.setattr(trained_val, "training_images", lambda st, tables: (7, None))
    found = trained_val.check(st, "run/lora", val_keys(edit_store), 1)
    assert found["checked"] is False, found
    assert found["why"] == "images v7 it trained on is not in this node's copy of s3://bucket/store (it caches the " \
                           "versions read)"


def test_pictures_of_an_images_version_a_repair_replaced_name_the_encoders_to_rerun(edit_store, images_fixture):
    """The val tables were encoded from images v1, which `store repair` then replaced by v2 and set aside: the
    pictures evaluate reads (after the loss passes) are refused with the encoders to rerun, not "no version v1;
    inspect lists the versions" (the user had just run the repair verify advised)."""
    from types import SimpleNamespace

    import pytest

    from schemas.errors import UserError
    from stages.evaluate.val_pictures import images_reader

    images_fixture.write(edit_store, images_fixture.edit_samples(), tag="b")
    st = Store(edit_store)
    v1 = fmt.version_dir(st.root, "images", 1)
    v1.rename(v1.with_name("v1.damaged"))  # as store/repair.py `set_aside` moves it
    lineage = SimpleNamespace(upstream={"images": 1})
    tables = SimpleNamespace(vae=SimpleNamespace(version=1, schema=SimpleNamespace(lineage=lineage)))
    with pytest.raises(UserError) as e:
        images_reader(st, tables)
    assert "images v1, which table 'vae' v1 was encoded from" in str(e.value)
    assert "replaced by a repair (set aside as v1.damaged/)" in str(e.value)
    assert "run `pipeline run encode-text` and `pipeline run encode-vae` to encode from images v2" in str(e.value)
    lineage.upstream = {"images": 2}
    images_reader(st, tables).close()  # the current one reads
