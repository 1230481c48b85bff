"""`pipeline store repair` of versions made before a fix (every store made before the fix revisions): repaired
under their own lineage, then the next run recomputes exactly what the fix changes. Without it, the repair
refused them ("cannot repair ... code_version '0.1.0+vae.1' -> '0.1.0+vae.2'"), naming settings the user never
changed."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import load_config
from stages.encode import vae as encode_vae
from stages.resize import stage as resize_stage
from store.verify import verify_store

sys.path.insert(0, str(Path(__file__).parent))
from damage import HEADER, flip_bit, key_at, sample_byte  # noqa: E402
from test_fix_revisions_encode import ALPHA, _alpha_source, _encode_before_fix, _same, _tables  # noqa: E402
from test_fix_revisions_resize import SMALL as MASK_SMALL, _build_before_fix, _source  # noqa: E402

runner = CliRunner()


def _config_file(path: Path, overrides: dict) -> Path:
    nested: dict = {}
    for dotted, value in overrides.items():
        section, name = dotted.split(".")
        nested.setdefault(section, {})[name] = value
    path.write_text(yaml.safe_dump(nested))
    return path


def _flip(root: Path, table: str, index: int) -> str:
    key = key_at(root, table, index)
    flip_bit(*sample_byte(root, table, key, HEADER, 3), 5)
    return key


def test_repair_of_latents_encoded_before_the_rgba_fix(tiny_plus_model, monkeypatch, tmp_path):
    settings = {**ALPHA, "encode_vae.shard_size_mb": 0.005}
    cfg, config = load_config(None, settings), _config_file(tmp_path / "c.yaml", settings)
    _alpha_source(tmp_path / "src", (True, False, True, False, False))
    for store in ("store", "fresh"):
        resize_stage.run(cfg, tmp_path / "src", tmp_path / store)
    _encode_before_fix(monkeypatch, cfg, tmp_path / "store", tiny_plus_model, stages=(encode_vae,))
    _flip(tmp_path / "store", "vae", 1)
    res = runner.invoke(app, ["store", "repair", str(tmp_path / "store"), "--model", tiny_plus_model,
                              "--config", str(config)])
    assert res.exit_code == 0, res.output
    assert verify_store(tmp_path / "store", progress=False) == []

    again = encode_vae.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
    assert again.encoded == 2  # the samples with a transparent picture: never trusted under vae.1
    encode_vae.run(cfg, tmp_path / "fresh", tiny_plus_model, batch_size=1)
    _same(_tables(tmp_path / "store", "vae"), _tables(tmp_path / "fresh", "vae"))


def test_repair_of_images_rendered_before_the_mask_fix(monkeypatch, tmp_path):
    settings = {**MASK_SMALL, "resize.shard_size_mb": 0.01}
    cfg, config = load_config(None, settings), _config_file(tmp_path / "c.yaml", settings)
    _source(tmp_path / "src", with_affected=True)
    _build_before_fix(monkeypatch, cfg, tmp_path / "src", tmp_path / "store")
    _flip(tmp_path / "store", "images", 0)
    res = runner.invoke(app, ["store", "repair", str(tmp_path / "store"), "--config", str(config)])
    assert res.exit_code == 0, res.output
    assert verify_store(tmp_path / "store", progress=False) == []
    resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    resize_stage.run(cfg, tmp_path / "src", tmp_path / "fresh")
    from tests.stages.test_fix_revisions_resize import _contents

    assert _contents(tmp_path / "store") == _contents(tmp_path / "fresh")
