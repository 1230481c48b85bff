"""A render setting an encoder does not read leaves its features current (schemas/pictures_lineage.py): a new
`control_vl_area` re-renders the `images` table, but the VAE reads none of the VL views, so its latents are
carried forward, not encoded again (before: every sample, hours at 1M). What the VAE reads (control_vae_area)
still re-encodes, and the carried table equals a fresh build."""

from __future__ import annotations

from pipeline.config import load_config
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from stages.resize import stage as resize_stage

from tests.stages.test_fix_revisions_encode import F32, _alpha_source, _same, _tables

N = 4
SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.val_fraction": 0.0, **F32}


def _encode(cfg, store, model, *stages):
    return [stage.run(cfg, store, model, batch_size=2) for stage in stages]


def test_a_vl_view_change_carries_the_vae_latents_forward(tiny_plus_model, tmp_path):
    _alpha_source(tmp_path / "src", (False,) * N)
    store = tmp_path / "store"
    resize_stage.run(load_config(None, SMALL), tmp_path / "src", store)
    _encode(load_config(None, SMALL), store, tiny_plus_model, encode_text, encode_vae)

    vl = load_config(None, {**SMALL, "resize.control_vl_area": 48 * 48})
    assert resize_stage.run(vl, tmp_path / "src", store).written == N  # every VL view re-rendered
    text, vae = _encode(vl, store, tiny_plus_model, encode_text, encode_vae)
    assert (text.encoded, text.reused) == (N, 0)  # the text encoder reads the VL views
    assert not vae.up_to_date and (vae.encoded, vae.reused) == (0, N)

    both = load_config(None, {**SMALL, "resize.control_vl_area": 48 * 48, "resize.control_vae_area": 48 * 48})
    resize_stage.run(both, tmp_path / "src", store)
    (vae,) = _encode(both, store, tiny_plus_model, encode_vae)
    assert (vae.encoded, vae.reused) == (N, 0)  # what it reads changed

    resize_stage.run(both, tmp_path / "src", tmp_path / "fresh")
    _encode(both, tmp_path / "fresh", tiny_plus_model, encode_vae)
    _same(_tables(store, "vae"), _tables(tmp_path / "fresh", "vae"))


def test_latents_encoded_before_the_read_lineage_are_carried_too(tiny_plus_model, monkeypatch, tmp_path):
    """A VAE table from before this release (its samples under the images' whole lineage) is carried forward
    across a VL view change too: the first change after the upgrade re-encodes nothing either."""
    _alpha_source(tmp_path / "src", (False,) * N)
    store = tmp_path / "store"
    resize_stage.run(load_config(None, SMALL), tmp_path / "src", store)
    with monkeypatch.context() as m:
        m.setattr(encode_vae, "VAE_UNREAD", ())  # what the earlier release hashed
        _encode(load_config(None, SMALL), store, tiny_plus_model, encode_vae)
    vl = load_config(None, {**SMALL, "resize.control_vl_area": 48 * 48})
    resize_stage.run(vl, tmp_path / "src", store)
    (vae,) = _encode(vl, store, tiny_plus_model, encode_vae)
    assert (vae.encoded, vae.reused) == (0, N)
