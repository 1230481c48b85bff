"""resize-bucket rerun with other sizes, then only one encoder: train and evaluate open `text` and `vae` encoded
from two `images` versions. Where the versions differ only in pictures one encoder reads (Edit-Plus: the target
and the VAE views are the VAE's alone), every sample's features are still of one render, and the stale table is
said in one line naming the command to run. Where they differ in a picture both read (Edit: its text encoder
reads the VAE-sized control too), a sample's text and latents would come from two renders of it: refused.
Before: trained on vae v1 (images v1) joined with text v2 (images v2) without a word."""

from __future__ import annotations

import logging

import pytest

from pipeline.config import load_config
from schemas.errors import UserError
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from stages.resize import stage as resize_stage

SETTINGS = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 64 * 64,
            "resize.multiple": 16, "resize.min_side": 16, "resize.val_fraction": 0.5, "resize.max_controls": 1,
            "resize.min_controls": 1, "encode_text.dtype": "float32", "encode_vae.dtype": "float32",
            "train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.sigma.sampling": "uniform",
            "train.max_steps": 2, "evaluate.device": "cpu", "evaluate.noise_seeds": [0],
            "evaluate.timesteps": [0.5], "evaluate.num_samples": 1, "evaluate.num_inference_steps": 2}
RESIZED = {"resize.target_area": 48 * 48, "resize.control_vae_area": 48 * 48}  # the repro's rerun: other sizes


def _store_after_resize_rerun(tmp_path, model):
    """resize-bucket, both encoders; resize-bucket again with RESIZED, then encode-text alone."""
    from pipeline.demo_data import make_demo_data

    make_demo_data(tmp_path / "src", n=12, fmt="folder", max_controls=1, seed=3)
    cfg = load_config(None, SETTINGS)
    resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    encode_text.run(cfg, tmp_path / "store", model)
    encode_vae.run(cfg, tmp_path / "store", model)
    cfg = load_config(None, {**SETTINGS, **RESIZED})
    resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    encode_text.run(cfg, tmp_path / "store", model)
    return cfg, tmp_path / "store"


def _stale_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is current (resize-bucket has run since)" in r.getMessage()]


def test_a_table_of_older_images_is_said_by_train_and_evaluate(tiny_plus_model, tmp_path, caplog, monkeypatch):
    from stages.evaluate import stage as evaluate
    from stages.train.recipe import run as train
    from store import Store

    cfg, store = _store_after_resize_rerun(tmp_path, tiny_plus_model)
    assert Store(store).tables() == {"images": 2, "text": 2, "vae": 1}
    with caplog.at_level(logging.WARNING):
        assert train(cfg, store, tiny_plus_model, tmp_path / "run").steps == 2
    said = _stale_lines(caplog)
    assert said and all(line == said[0] for line in said), said  # one line (the same if several opens say it)
    assert said[0].startswith(f"train: store {store}: table 'vae' v1 was encoded from images v1, "
                              "but images v2 is current")
    assert "run `pipeline run encode-vae`" in said[0] and "encode-text" not in said[0]
    from features import images_versions

    # a launch: rank 0 says it, the other ranks (which read the same schemas) do not repeat it
    st = Store(store)
    readers = {t: st.reader(t) for t in ("text", "vae")}
    for rank, lines in (("1", 0), ("0", 1)):
        images_versions._SAID.clear()
        caplog.clear()
        monkeypatch.setenv("RANK", rank)
        with caplog.at_level(logging.WARNING):
            images_versions.check_images_versions(st, readers, "train")
        assert len(_stale_lines(caplog)) == lines, (rank, _stale_lines(caplog))
    monkeypatch.delenv("RANK")
    for r in readers.values():
        r.close()

    images_versions._SAID.clear()  # as a new process: evaluate says it too
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        evaluate.run(cfg.evaluate, store, tiny_plus_model, tmp_path / "run" / "lora", tmp_path / "report")
    assert any(line.startswith(f"evaluate: store {store}: table 'vae' v1 was encoded from images v1")
               for line in _stale_lines(caplog))

    encode_vae.run(cfg, store, tiny_plus_model)  # what the line says to run: nothing more to say
    images_versions._SAID.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert train(cfg, store, tiny_plus_model, tmp_path / "run2").steps == 2
    assert not _stale_lines(caplog)


def test_features_of_two_renders_of_a_sample_are_refused(tiny_edit_model, tmp_path):
    """Edit: the text encoder reads control_0.png, sized by resize.control_vae_area, as the VAE does."""
    from stages.train.recipe import run as train

    cfg, store = _store_after_resize_rerun(tmp_path, tiny_edit_model)
    with pytest.raises(UserError) as e:
        train(cfg, store, tiny_edit_model, tmp_path / "run")
    msg = str(e.value)
    assert "table 'text' v2 was encoded from images v2 and table 'vae' v1 from images v1" in msg
    assert "resize.control_vae_area 4096 in images v1, 2304 in v2" in msg and "target_area" not in msg
    assert "run `pipeline run encode-vae`" in msg
    encode_vae.run(cfg, store, tiny_edit_model)
    assert train(cfg, store, tiny_edit_model, tmp_path / "run").steps == 2


def test_an_images_version_a_repair_replaced_is_said_so(edit_store, images_fixture, caplog):
    """text and vae were encoded from images v1, which `store repair` replaced by v2 and set aside as
    v1.damaged/: the line said "resize-bucket has run since", which had not run."""
    from types import SimpleNamespace

    from features import images_versions
    from store import Store
    from store import format as fmt

    images_fixture.write(edit_store, images_fixture.edit_samples(), tag="b")  # images v2
    v1 = fmt.version_dir(edit_store, "images", 1)
    v1.rename(v1.with_name("v1.damaged"))  # as store/repair.py `set_aside` moves it
    readers = {t: SimpleNamespace(version=1, schema=SimpleNamespace(lineage=SimpleNamespace(upstream={"images": 1})))
               for t in ("text", "vae")}
    images_versions._SAID.clear()
    with caplog.at_level(logging.WARNING):
        images_versions.check_images_versions(Store(edit_store), readers, "evaluate")
    said = [r.getMessage() for r in caplog.records if "images v2 is current" in r.getMessage()]
    assert len(said) == 1 and "table 'vae' v1 was encoded from images v1" in said[0]
    assert "images v2 is current (a repair replaced the damaged images v1, set aside as v1.damaged/)" in said[0]
    assert "resize-bucket" not in said[0]
