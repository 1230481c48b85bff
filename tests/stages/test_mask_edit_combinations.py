"""A mask edit together with another change: the `vae` table encode-vae leaves (its latents kept where only the
mask changed, `stages/encode/mask_only.py`) is the one a fresh encode writes, tensors, meta and `latents_sha256`
alike, and `store verify` finds nothing; evaluate, which reads the masks whatever train's weights, reports again
while the run stays current under weights 1 / 1; masks added or removed under other weights train again."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from pipeline.config import load_config
from stages.encode import vae as encode_vae
from stages.resize import stage as resize_stage
from store.store import Store
from store.verify import verify_store

from tests.stages.test_encode_text_carry import LARGER, SMALL, SMALL_21, _source
from tests.stages.test_encode_vae_mask_edit import _mask
from tests.stages.test_encode_vae_recaption import CAPTIONS, _meta
from tests.stages.test_fix_revisions_encode import ALPHA, _alpha_source, _same, _tables

COLUMNS = ("latents_sha256", "has_mask", "mask_sha256", "split", "img_shapes")
TRAIN = {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.sigma.sampling": "uniform",
         "train.max_steps": 2, "train.checkpoint_every": 2}
WEIGHTS = {"train.loss.mask_weight.background": 0.5, "train.loss.mask_weight.foreground": 2.0}


def _columns(store) -> dict:
    with Store(store).reader("vae") as r:
        return {k: {c: r.meta(k).get(c) for c in COLUMNS} for k in r.keys()}


def _as_fresh(cfg, src, store, fresh, model) -> None:
    resize_stage.run(cfg, src, fresh)
    encode_vae.run(cfg, fresh, model, batch_size=2)
    _same(_tables(store, "vae"), _tables(fresh, "vae"))
    assert _meta(store) == _meta(fresh) and _columns(store) == _columns(fresh)
    assert verify_store(store, progress=False) == []


def _encoded(tmp_path, model, overrides, source=None):
    src, store = tmp_path / "src", tmp_path / "store"
    (source or _source)(src)
    _mask(src, "s0", seed=1)
    cfg = load_config(None, overrides)
    resize_stage.run(cfg, src, store)
    encode_vae.run(cfg, store, model, batch_size=2)
    return src, store


def _target_changed(src, cfg):
    arr = np.random.default_rng(77).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(arr).save(src / "target" / "s0.png")
    return cfg


def _recaptioned(src, cfg):
    (src / "target" / "s0.txt").write_text("another caption")
    return cfg


@pytest.mark.parametrize("change", [
    lambda src, cfg: load_config(None, LARGER),  # the target area: another render
    lambda src, cfg: load_config(None, {**SMALL, "resize.val_fraction": 0.5}),  # the split
    _recaptioned, _target_changed,
    lambda src, cfg: _mask(src, "s0", seed=3, size=(32, 32)) or cfg,  # a mask of half size, fitted on its target
], ids=["target_area", "split", "recaption", "target", "mask_size"])
def test_a_mask_edit_with_another_change_writes_a_fresh_encodes_table(tiny_edit_model, tmp_path, change):
    src, store = _encoded(tmp_path, tiny_edit_model, SMALL)
    _mask(src, "s0", seed=2)
    cfg = change(src, load_config(None, SMALL))
    resize_stage.run(cfg, src, store)
    encode_vae.run(cfg, store, tiny_edit_model, batch_size=2)
    _as_fresh(cfg, src, store, tmp_path / "fresh", tiny_edit_model)


@pytest.mark.parametrize("variant", ["keep_alpha_flip", "qwen-image-2.1"])
def test_a_mask_edit_of_rgba_pictures(tiny_edit_model, tiny_21_model, tmp_path, variant):
    model, before = (tiny_edit_model, ALPHA) if variant == "keep_alpha_flip" else (tiny_21_model, SMALL_21)
    src, store = _encoded(tmp_path, model, before, lambda root: _alpha_source(root, (True, False, True)))
    _mask(src, "s0", seed=2)
    _mask(src, "s2", seed=3)
    cfg = load_config(None, {**ALPHA, "resize.keep_alpha": False} if variant == "keep_alpha_flip" else before)
    resize_stage.run(cfg, src, store)
    encode_vae.run(cfg, store, model, batch_size=2)
    _as_fresh(cfg, src, store, tmp_path / "fresh", model)


def _encode_all(cfg, src, store, model) -> None:
    from stages.encode import text as encode_text

    resize_stage.run(cfg, src, store)
    encode_text.run(cfg, store, model, batch_size=2)
    encode_vae.run(cfg, store, model, batch_size=2)


def test_evaluate_reports_again_after_a_mask_edit_the_run_does_not_weigh(tiny_edit_model, tmp_path):
    from schemas.config import EvaluateConfig
    from stages.evaluate import stage as evaluate
    from stages.train.recipe import run as train, up_to_date

    src, store, out = tmp_path / "src", tmp_path / "store", tmp_path / "run"
    _source(src, CAPTIONS)
    for i in range(4):
        _mask(src, f"s{i}", seed=10 + i)
    cfg = load_config(None, {**SMALL, **TRAIN, "resize.val_fraction": 0.5})
    _encode_all(cfg, src, store, tiny_edit_model)
    train(cfg, store, tiny_edit_model, out)
    ecfg = EvaluateConfig(noise_seeds=[0], timesteps=[0.5], batch_size=4, num_samples=0, num_inference_steps=2,
                          device="cpu")
    evaluate.run(ecfg, store, tiny_edit_model, out / "lora", tmp_path / "report", skip_if_done=True)
    for i in range(4):
        _mask(src, f"s{i}", seed=50 + i)
    _encode_all(cfg, src, store, tiny_edit_model)
    assert up_to_date(cfg, store, tiny_edit_model, out)  # weights 1 / 1: the masks weigh nothing in training
    again = evaluate.run(ecfg, store, tiny_edit_model, out / "lora", tmp_path / "report", skip_if_done=True)
    assert not again.up_to_date  # its inside / outside-mask losses read the masks now


@pytest.mark.parametrize("case", ["added", "removed"])
def test_masks_added_or_removed_under_weights_train_again(tiny_edit_model, tmp_path, case):
    from stages.train.recipe import run as train, up_to_date

    src, store, out = tmp_path / "src", tmp_path / "store", tmp_path / "run"
    _source(src, CAPTIONS)
    if case == "removed":
        _mask(src, "s0", seed=1)
    cfg = load_config(None, {**SMALL, **TRAIN, **WEIGHTS})
    _encode_all(cfg, src, store, tiny_edit_model)
    train(cfg, store, tiny_edit_model, out)
    assert up_to_date(cfg, store, tiny_edit_model, out)
    if case == "added":
        _mask(src, "s0", seed=1)
    else:
        (src / "mask" / "s0.png").unlink()
    _encode_all(cfg, src, store, tiny_edit_model)
    assert not up_to_date(cfg, store, tiny_edit_model, out)
