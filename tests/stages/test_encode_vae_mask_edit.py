"""An edited mask changes a sample's mask weights, never its latents (the key hashes the pictures and the caption,
not the mask): encode-vae keeps the stored latents and computes only `mask_weight` (before: the sample's target and
controls through the VAE again), and the table is the one a fresh encode writes."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from pipeline.config import load_config
from stages.encode import vae as encode_vae
from stages.resize import stage as resize_stage

from tests.stages.test_encode_text_carry import SMALL, _source
from tests.stages.test_encode_vae_recaption import CAPTIONS, _meta
from tests.stages.test_fix_revisions_encode import _same, _tables


def _mask(src, name: str, seed: int, size: tuple[int, int] = (64, 64)) -> None:
    (src / "mask").mkdir(exist_ok=True)
    arr = (np.random.default_rng(seed).random(size[::-1]) > 0.5).astype(np.uint8) * 255
    Image.fromarray(arr, mode="L").save(src / "mask" / f"{name}.png")


def _encode_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = encode_vae.encode_batch
    monkeypatch.setattr(encode_vae, "encode_batch", lambda vae, reqs, *a: calls.append(len(reqs)) or real(vae, reqs, *a))
    return calls


def _fresh(cfg, src, store, model) -> None:
    resize_stage.run(cfg, src, store)
    encode_vae.run(cfg, store, model, batch_size=2)


def test_a_mask_edit_computes_only_the_mask_weights(tiny_edit_model, monkeypatch, tmp_path):
    src, store = tmp_path / "src", tmp_path / "store"
    _source(src, CAPTIONS)
    _mask(src, "s0", seed=1)
    cfg = load_config(None, SMALL)
    resize_stage.run(cfg, src, store)
    encode_vae.run(cfg, store, tiny_edit_model, batch_size=2)
    calls = _encode_calls(monkeypatch)

    _mask(src, "s0", seed=2)  # another mask for s0, a first one for s1
    _mask(src, "s1", seed=3)
    assert resize_stage.run(cfg, src, store).written == 2
    vae = encode_vae.run(cfg, store, tiny_edit_model, batch_size=2)
    assert (vae.encoded, vae.completed, vae.reused) == (0, 2, 1) and calls == []
    _same(_tables(store, "vae"), _tables(_fresh_at(cfg, src, tmp_path / "fresh1", tiny_edit_model), "vae"))
    assert _meta(store) == _meta(tmp_path / "fresh1")
    calls.clear()  # the fresh encode's

    (src / "mask" / "s0.png").unlink()  # a mask removed: no weights
    assert resize_stage.run(cfg, src, store).written == 1
    vae = encode_vae.run(cfg, store, tiny_edit_model, batch_size=2)
    assert (vae.encoded, vae.completed, vae.reused) == (0, 1, 2) and calls == []
    _same(_tables(store, "vae"), _tables(_fresh_at(cfg, src, tmp_path / "fresh2", tiny_edit_model), "vae"))
    assert _meta(store) == _meta(tmp_path / "fresh2")
    assert encode_vae.run(cfg, store, tiny_edit_model, batch_size=2).up_to_date


def _fresh_at(cfg, src, store, model):
    _fresh(cfg, src, store, model)
    return store


TRAIN = {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.sigma.sampling": "uniform",
         "train.max_steps": 2, "train.checkpoint_every": 2}


@pytest.mark.parametrize("weights", [{}, {"train.loss.mask_weight.background": 0.5}])
def test_a_mask_edit_retrains_only_where_the_mask_weighs(tiny_edit_model, tmp_path, weights):
    """Weights 1 / 1 read no mask: the finished run stays current across a mask edit (its vae table named by the
    latents alone, `latents_sha256`); other weights train again. Before: trained again under both."""
    from stages.encode import text as encode_text
    from stages.train.recipe import run as train, up_to_date

    src, store, out = tmp_path / "src", tmp_path / "store", tmp_path / "run"
    _source(src, CAPTIONS)
    _mask(src, "s0", seed=1)
    cfg = load_config(None, {**SMALL, **TRAIN, **weights})

    def encode() -> None:
        resize_stage.run(cfg, src, store)
        encode_text.run(cfg, store, tiny_edit_model, batch_size=2)
        encode_vae.run(cfg, store, tiny_edit_model, batch_size=2)

    encode()
    train(cfg, store, tiny_edit_model, out)
    assert up_to_date(cfg, store, tiny_edit_model, out)
    _mask(src, "s0", seed=2)
    encode()
    assert up_to_date(cfg, store, tiny_edit_model, out) == (not weights)


def test_edited_masks_read_their_pictures_a_few_samples_at_a_time(tiny_edit_model, monkeypatch, tmp_path):
    """Every edited sample's `images` files (target, controls, mask) were read in one call and held together: a
    dataset's masks redone held a rank's whole share of pictures in memory. Now `mask_only.STEP` at a time."""
    from stages.encode import mask_only
    from store.reader import TableReader

    src, store = tmp_path / "src", tmp_path / "store"
    _source(src, CAPTIONS)
    cfg = load_config(None, SMALL)
    resize_stage.run(cfg, src, store)
    encode_vae.run(cfg, store, tiny_edit_model, batch_size=2)
    for i in range(3):
        _mask(src, f"s{i}", seed=10 + i)
    resize_stage.run(cfg, src, store)
    monkeypatch.setattr(mask_only, "STEP", 2, raising=False)
    held, real = [], TableReader.files_of

    def files_of(self, keys, *a):
        held.append(len(keys))
        return real(self, keys, *a)

    monkeypatch.setattr(TableReader, "files_of", files_of)
    vae = encode_vae.run(cfg, store, tiny_edit_model, batch_size=2)
    assert (vae.encoded, vae.completed) == (0, 3) and held == [2, 1]
    _same(_tables(store, "vae"), _tables(_fresh_at(cfg, src, tmp_path / "fresh", tiny_edit_model), "vae"))


def test_edited_masks_read_the_stored_manifest_once(tiny_edit_model, monkeypatch, tmp_path):
    """The search for carriable rows found the edited samples' stored rows; the mask-only rewrite searched every
    carriable key again (the stored manifest read twice). Now it takes the rows the first search found."""
    from store import reuse

    src, store = tmp_path / "src", tmp_path / "store"
    _source(src, CAPTIONS)
    cfg = load_config(None, SMALL)
    resize_stage.run(cfg, src, store)
    encode_vae.run(cfg, store, tiny_edit_model, batch_size=2)
    _mask(src, "s0", seed=4)
    resize_stage.run(cfg, src, store)
    reads, real = [], reuse._wanted_rows

    def wanted_rows(store_, table, version, *a):
        found = real(store_, table, version, *a)
        if found is not None:  # a version of this lineage: its manifest's rows read
            reads.append((table, version))
        return found

    monkeypatch.setattr(reuse, "_wanted_rows", wanted_rows)
    vae = encode_vae.run(cfg, store, tiny_edit_model, batch_size=2)
    assert (vae.encoded, vae.completed, vae.reused) == (0, 1, 2) and reads == [("vae", 1)]
    _same(_tables(store, "vae"), _tables(_fresh_at(cfg, src, tmp_path / "fresh", tiny_edit_model), "vae"))
