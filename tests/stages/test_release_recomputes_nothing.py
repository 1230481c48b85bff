"""A new release of the package (its installed version changed) recomputes nothing by itself: the tables stay
current. Before: the installed package version was part of every lineage, so an upgrade re-rendered and
re-encoded every table of every store (a million samples, for a version number)."""

from __future__ import annotations

from importlib import metadata

from pipeline.config import load_config
from stages.encode import vae as encode_vae
from stages.resize import stage as resize_stage

from tests.stages.test_fix_revisions_encode import ALPHA, _alpha_source


def test_a_new_package_version_keeps_every_table_current(tiny_plus_model, monkeypatch, tmp_path):
    cfg = load_config(None, ALPHA)
    _alpha_source(tmp_path / "src", (False, True))
    images = resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    vae = encode_vae.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "9.9.9" if name == "qwen-edit-lora-pipeline" else real(name))
    again = resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    assert again.up_to_date and again.version == images.version
    again = encode_vae.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
    assert again.up_to_date and again.version == vae.version
