"""A new training resolution (`resize.target_area`) re-renders the `images` table, but the text encoder reads no
target picture (schemas/pictures_lineage.py `TEXT_UNREAD`): its samples are carried forward, not encoded again
(before: every sample through the VL encoder, hours at 1M). A carried row takes the images' img_shapes now, and one
whose prompt no longer fits the transformer's text positions next to the new images is rejected ("caption too
long") exactly as a fresh encode rejects it; the table equals a fresh encode at the new size."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

import models.multires
from features.open import open_features
from models.loading import model_fingerprint
from pipeline.config import load_config
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from stages.resize import stage as resize_stage
from store import Store

from tests.stages.test_fix_revisions_encode import F32, _same, _tables

SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.val_fraction": 0.0, **F32}
LARGER = {**SMALL, "resize.target_area": 128 * 128}  # the target's extent: 2 -> 4 patches (RoPE text start)
# Qwen-Image-2.1: RGBA references in 32 px slots, no VL views (configs/qwen-image-2.1.yaml)
SMALL_21 = {**SMALL, "resize.multiple": 32, "resize.min_side": 32, "resize.keep_alpha": True,
            "resize.vl_views": False}
CAPTIONS = ("edit 0", "make the sky red", "add a hat", "rotate it a little to the left and then make every colour of "
            "the picture warmer, brighter and more saturated than before")  # the last one: much longer


def _source(root, captions=CAPTIONS) -> None:
    for d in ("target", "control"):
        (root / d).mkdir(parents=True)
    for i, caption in enumerate(captions):
        for d, seed in (("target", i), ("control", 100 + i)):
            arr = np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / d / f"s{i}.png")
        (root / "target" / f"s{i}.txt").write_text(caption)


def _encoder_calls(monkeypatch) -> list[int]:
    """Requests (prompt, empty prompt) that reach the Edit / Edit-Plus text encoder."""
    calls: list[int] = []
    real = encode_text.encode_batch

    def counted(text_encoder, requests, *a, **k):
        calls.append(len(requests))
        return real(text_encoder, requests, *a, **k)

    monkeypatch.setattr(encode_text, "encode_batch", counted)
    return calls


def _rows(store, table: str) -> dict[str, dict]:
    with Store(store).reader(table) as r:
        return {k: {c: r.meta(k)[c] for c in ("img_shapes", "length", "empty_length", "num_controls", "split")}
                for k in r.keys()}


def _lengths(store, model: str) -> dict[str, int]:
    """Key -> the joint sequence length train orders and batches by (text length + the vae's image tokens)."""
    with open_features(store, model, model_fingerprint(model), max_dropped_fraction=1.0) as joined:
        for i in range(len(joined)):  # train's read: latents checked against the img_shapes it is given
            key, text, vae, shapes, _ = joined.features_at(i)
            assert [list(s) for s in shapes] == joined.text.meta(key)["img_shapes"]
        return dict(zip(joined.keys, (int(n) for n in joined.lengths)))


@pytest.mark.parametrize("model", ["tiny_plus_model", "tiny_edit_model"])
def test_a_new_target_size_carries_the_text_forward(model, request, monkeypatch, tmp_path):
    model = request.getfixturevalue(model)
    _source(tmp_path / "src")
    store, fresh = tmp_path / "store", tmp_path / "fresh"
    resize_stage.run(load_config(None, SMALL), tmp_path / "src", store)
    for stage in (encode_text, encode_vae):
        stage.run(load_config(None, SMALL), store, model, batch_size=2)
    before = _rows(store, "text")
    longest = max(before.values(), key=lambda r: r["length"])
    assert sorted(r["length"] for r in before.values())[-2] < longest["length"] - 1
    # the RoPE table made just long enough for the longest prompt next to the 64 px target (extent 2), not next
    # to the 128 px one (extent 4): that sample stops fitting, the others still fit
    monkeypatch.setattr(models.multires, "_rope_table_positions", lambda: longest["length"] + 2)

    cfg = load_config(None, LARGER)
    assert resize_stage.run(cfg, tmp_path / "src", store).written == len(CAPTIONS)  # every target re-rendered
    calls = _encoder_calls(monkeypatch)
    text = encode_text.run(cfg, store, model, batch_size=2)
    assert not text.up_to_date and (text.encoded, text.reused, text.quarantined) == (0, len(CAPTIONS) - 1, 1)
    assert calls == []  # the VL encoder never ran
    too_long = next(k for k, r in before.items() if r is longest)
    rows = {q["key"]: q for q in Store(store).quarantine().to_pylist() if q["stage"] == "encode-text"}
    assert rows[too_long]["reason"] == "caption too long"
    vae = encode_vae.run(cfg, store, model, batch_size=2)
    assert vae.encoded == len(CAPTIONS)  # the VAE reads the target
    assert encode_text.run(cfg, store, model, batch_size=2).up_to_date

    resize_stage.run(cfg, tmp_path / "src", fresh)
    for stage in (encode_text, encode_vae):
        stage.run(cfg, fresh, model, batch_size=2)
    assert too_long not in _rows(fresh, "text")  # a fresh encode at this size rejects it too
    carried = _rows(store, "text")
    assert carried == _rows(fresh, "text")  # img_shapes: the new targets', as a fresh encode stores them
    assert all(r["img_shapes"][0] == [1, 8, 8] for r in carried.values())
    _same(_tables(store, "text", "vae"), _tables(fresh, "text", "vae"))
    assert _lengths(store, model) == _lengths(fresh, model)


def test_the_21_text_is_carried_to_a_new_target_size(tiny_21_model, tmp_path):
    _source(tmp_path / "src")
    store, fresh = tmp_path / "store", tmp_path / "fresh"
    resize_stage.run(load_config(None, SMALL_21), tmp_path / "src", store)
    encode_text.run(load_config(None, SMALL_21), store, tiny_21_model)
    cfg = load_config(None, {**SMALL_21, "resize.target_area": 128 * 128})
    resize_stage.run(cfg, tmp_path / "src", store)
    text = encode_text.run(cfg, store, tiny_21_model)
    assert (text.encoded, text.reused) == (0, len(CAPTIONS))
    resize_stage.run(cfg, tmp_path / "src", fresh)
    encode_text.run(cfg, fresh, tiny_21_model)
    assert _rows(store, "text") == _rows(fresh, "text")
    _same(_tables(store, "text"), _tables(fresh, "text"))

    # what the 2.1 text encoder reads (each reference, sized by control_vae_area) still re-encodes
    refs = load_config(None, {**SMALL_21, "resize.target_area": 128 * 128, "resize.control_vae_area": 128 * 128})
    resize_stage.run(refs, tmp_path / "src", store)
    assert encode_text.run(refs, store, tiny_21_model).encoded == len(CAPTIONS)


def test_text_encoded_before_this_release_is_carried_and_stays_current(tiny_plus_model, monkeypatch, tmp_path):
    """A text table from before this release (its samples under the images' whole lineage) stays up to date, and
    is carried forward across a target size change too: an upgrade re-encodes nothing."""
    _source(tmp_path / "src")
    store = tmp_path / "store"
    resize_stage.run(load_config(None, SMALL), tmp_path / "src", store)
    with monkeypatch.context() as m:
        m.setattr(encode_text, "TEXT_UNREAD", {"edit": (), "edit-plus": ()})  # what the earlier release hashed
        old = encode_text.run(load_config(None, SMALL), store, tiny_plus_model, batch_size=2)
    again = encode_text.run(load_config(None, SMALL), store, tiny_plus_model, batch_size=2)
    assert again.up_to_date and again.version == old.version
    cfg = load_config(None, LARGER)
    resize_stage.run(cfg, tmp_path / "src", store)
    text = encode_text.run(cfg, store, tiny_plus_model, batch_size=2)
    assert (text.encoded, text.reused) == (0, len(CAPTIONS))
    assert all(r["img_shapes"][0] == [1, 8, 8] for r in _rows(store, "text").values())


@pytest.mark.parametrize("stage, unread, before", [
    (encode_text, "TEXT_UNREAD", {"edit": (), "edit-plus": ()}), (encode_vae, "VAE_UNREAD", ())])
def test_repair_of_a_table_encoded_before_its_read_lineage(stage, unread, before, tiny_plus_model, monkeypatch,
                                                           tmp_path):
    """`store repair` of a table from before its stage left out the render settings it does not read (samples
    under the images' whole lineage) completes its repair version under that lineage, recomputing only the
    damaged sample. Before, the stage wrote under the read lineage, a schema the repair version does not hold: it
    encoded every sample into another version and the repair stopped ("did not complete v2")."""
    from typer.testing import CliRunner

    from pipeline.cli import app
    from store.verify import verify_store
    from tests.damage import HEADER, flip_bit, key_at, sample_byte
    from tests.stages.test_fix_revisions_repair import _config_file

    settings = {**SMALL, f"{stage.STAGE.replace('-', '_')}.shard_size_mb": 0.001}  # a shard per sample
    _source(tmp_path / "src")
    store = tmp_path / "store"
    resize_stage.run(load_config(None, settings), tmp_path / "src", store)
    with monkeypatch.context() as m:
        m.setattr(stage, unread, before)  # what the earlier release hashed
        stage.run(load_config(None, settings), store, tiny_plus_model, batch_size=2)
    stored = _tables(store, stage.TABLE)
    key = key_at(store, stage.TABLE, 1)
    flip_bit(*sample_byte(store, stage.TABLE, key, HEADER, 3), 5)
    res = CliRunner().invoke(app, ["store", "repair", str(store), "--model", tiny_plus_model,
                                   "--config", str(_config_file(tmp_path / "c.yaml", settings))])
    assert res.exit_code == 0, res.output
    assert "recomputing 1 damaged sample" in res.output
    assert verify_store(store, progress=False) == []
    _same(_tables(store, stage.TABLE), stored)
    assert stage.run(load_config(None, settings), store, tiny_plus_model, batch_size=2).up_to_date
