"""`pipeline store repair` of versions made before a fix (every store made before the fix revisions): the samples
the repair recomputes are the current revision's, so it writes them under the current lineage, recomputing what the
fixes change as well and carrying the rest; the next run then recomputes nothing. Before, the repaired samples were
recorded under the old revision's lineage and the next run recomputed those the fixes change again (with the
rest of them); before that, the repair refused such versions ("cannot repair ... code_version '0.1.0+vae.1' ->
'0.1.0+vae.2'"), naming settings the user never changed."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import load_config
from schemas.fixes import has_alpha_picture
from stages.encode import text as encode_text, vae as encode_vae
from stages.resize import stage as resize_stage
from store import Store
from store.verify import verify_store

sys.path.insert(0, str(Path(__file__).parent))
from damage import HEADER, flip_bit, sample_byte  # noqa: E402
from test_fix_revisions_encode import ALPHA, _alpha_source, _encode_before_fix, _same, _tables  # noqa: E402
from test_fix_revisions_resize import SMALL as MASK_SMALL, _build_before_fix, _jpeg, _mask, _source  # noqa: E402
from test_fix_revisions_resize import revision_3_code  # noqa: F401,E402 - autouse: revision 3's fixes as made

runner = CliRunner()


def _config_file(path: Path, overrides: dict) -> Path:
    nested: dict = {}
    for dotted, value in overrides.items():
        section, name = dotted.split(".")
        nested.setdefault(section, {})[name] = value
    path.write_text(yaml.safe_dump(nested))
    return path


def _damage_shards_of(root: Path, table: str, *keys: str) -> list[str]:
    """A bit flipped in every sample of the shards holding `keys`; returns the keys of those shards."""
    with Store(root).reader(table) as r:
        shard_of = dict(zip(r.keys(), r.manifest.column("shard").to_pylist()))
    damaged = [k for k, s in shard_of.items() if s in {shard_of[k] for k in keys}]
    for k in damaged:
        flip_bit(*sample_byte(root, table, k, HEADER, 3), 5)
    return damaged


def test_repair_of_features_encoded_before_the_rgba_fix_leaves_nothing_to_recompute(tiny_plus_model, monkeypatch,
                                                                                   tmp_path):
    # batch 1 everywhere: the repaired store is compared bit for bit with a fresh one (float32 sums by batch)
    settings = {**ALPHA, "encode_vae.shard_size_mb": 0.005, "encode_text.shard_size_mb": 0.005,
                "encode_vae.batch_size": 1, "encode_text.batch_size": 1}
    cfg, config = load_config(None, settings), _config_file(tmp_path / "c.yaml", settings)
    _alpha_source(tmp_path / "src", (True, False, True, False, False))
    for store in ("store", "fresh"):
        resize_stage.run(cfg, tmp_path / "src", tmp_path / store)
    _encode_before_fix(monkeypatch, cfg, tmp_path / "store", tiny_plus_model)
    with Store(tmp_path / "store").reader("images") as r:
        alpha = sorted(k for k in r.keys() if has_alpha_picture(r.meta(k)))
    assert len(alpha) == 2
    for table in ("text", "vae"):  # a shard holding a sample the fix changes
        assert alpha[0] in _damage_shards_of(tmp_path / "store", table, alpha[0])
    res = runner.invoke(app, ["store", "repair", str(tmp_path / "store"), "--model", tiny_plus_model,
                              "--config", str(config)])
    assert res.exit_code == 0, res.output
    assert "repaired as v3 (its damaged samples and those the fixes since change recomputed" in res.output
    # the line before the stage ran named the repair version it then superseded ("... into v2")
    assert "into v2" not in res.output, res.output
    assert verify_store(tmp_path / "store", progress=False) == []
    assert sorted(p.name for p in (tmp_path / "store" / "vae").iterdir() if not p.name.startswith(".")) == \
        ["v1.damaged", "v1.damaged.json", "v3"]  # the repair version the stage superseded (v2) is gone

    for stage in (encode_text, encode_vae):  # every sample reused: the repaired ones were this revision's
        again = stage.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
        assert (again.up_to_date, again.encoded, again.version) == (True, 0, 3)  # before: encoded 2 (the alpha ones)
        stage.run(cfg, tmp_path / "fresh", tiny_plus_model, batch_size=1)
    _same(_tables(tmp_path / "store", "text", "vae"), _tables(tmp_path / "fresh", "text", "vae"))


def test_repair_of_images_rendered_before_the_mask_fix(monkeypatch, tmp_path):
    settings = {**MASK_SMALL, "resize.shard_size_mb": 0.01}
    cfg, config = load_config(None, settings), _config_file(tmp_path / "c.yaml", settings)
    _source(tmp_path / "src", with_affected=True)
    # a mask of its target's aspect at half its size: resized by every revision, so the rows of revision 1 (and 2)
    # holding it are re-rendered by revision 3 (which cannot tell it from a stretched one)
    (tmp_path / "src" / "target" / "halfmask.jpg").write_bytes(_jpeg(1, 13))
    (tmp_path / "src" / "target" / "halfmask.txt").write_text("edit halfmask")
    (tmp_path / "src" / "mask" / "halfmask.png").write_bytes(_mask(48, 32))
    _build_before_fix(monkeypatch, cfg, tmp_path / "src", tmp_path / "store")
    with Store(tmp_path / "store").reader("images") as r:  # samples the fixes render otherwise, damaged
        damaged = [k for k in r.keys() if any(n in r.meta(k)["source"] for n in ("stored", "halfmask"))]
    _damage_shards_of(tmp_path / "store", "images", *damaged)
    res = runner.invoke(app, ["store", "repair", str(tmp_path / "store"), "--config", str(config)])
    assert res.exit_code == 0, res.output
    assert "images: v1 repaired as v3" in res.output and "into v2" not in res.output, res.output  # v2: superseded
    assert verify_store(tmp_path / "store", progress=False) == []
    rerun = resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    assert (rerun.up_to_date, rerun.written) == (True, 0)  # before: the re-rendered masked samples again
    resize_stage.run(cfg, tmp_path / "src", tmp_path / "fresh")
    from tests.stages.test_fix_revisions_resize import _contents

    assert _contents(tmp_path / "store") == _contents(tmp_path / "fresh")
