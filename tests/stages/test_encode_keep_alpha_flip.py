"""resize.keep_alpha flipped on a store whose pictures are mostly opaque: an opaque picture renders the same bytes
under either value (features/decode.py), so resize-bucket renders again, and the encoders encode again, only the
samples with a transparent picture, the rest carried forward (before: every sample rendered and sent through both
encoders again, hours at 1M, for the same tensors). The tables equal a fresh run's."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pipeline.config import load_config
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from stages.resize import stage as resize_stage
from store import Store

from tests.stages.test_fix_revisions_encode import F32, _same, _tables

SMALL = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 32 * 32,
         "resize.multiple": 16, "resize.min_side": 16, "resize.val_fraction": 0.0, **F32}


def _png(seed: int, transparent: bool) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    if not transparent:
        im = Image.fromarray(rgb)
    else:  # left half: alpha 0
        alpha = np.full((64, 64, 1), 255, np.uint8)
        alpha[:, :32] = 0
        im = Image.fromarray(np.concatenate([rgb, alpha], axis=2), "RGBA")
    b = io.BytesIO()
    im.save(b, format="PNG")
    return b.getvalue()


def _source(root) -> None:
    for d in ("target", "control"):
        (root / d).mkdir(parents=True)
    for i in range(3):  # s0's target has transparency; s1, s2 are opaque
        (root / "target" / f"s{i}.png").write_bytes(_png(i, transparent=i == 0))
        (root / "control" / f"s{i}.png").write_bytes(_png(100 + i, transparent=False))
        (root / "target" / f"s{i}.txt").write_text(f"edit {i}")


@pytest.mark.parametrize("before", [False, True])
def test_a_keep_alpha_flip_encodes_only_the_samples_with_transparency(before, tiny_plus_model, tmp_path):
    _source(tmp_path / "src")
    store, fresh = tmp_path / "store", tmp_path / "fresh"
    resize_stage.run(load_config(None, {**SMALL, "resize.keep_alpha": before}), tmp_path / "src", store)
    for stage in (encode_text, encode_vae):
        stage.run(load_config(None, {**SMALL, "resize.keep_alpha": before}), store, tiny_plus_model, batch_size=2)

    cfg = load_config(None, {**SMALL, "resize.keep_alpha": not before})
    rendered = resize_stage.run(cfg, tmp_path / "src", store)
    assert (rendered.written, rendered.reused) == (1, 2)  # s0 alone rendered again
    for stage in (encode_text, encode_vae):
        summary = stage.run(cfg, store, tiny_plus_model, batch_size=2)
        assert (summary.encoded, summary.reused) == (1, 2), stage.__name__
        assert stage.run(cfg, store, tiny_plus_model, batch_size=2).up_to_date

    resize_stage.run(cfg, tmp_path / "src", fresh)
    for stage in (encode_text, encode_vae):
        stage.run(cfg, fresh, tiny_plus_model, batch_size=2)
    assert _pictures(store) == _pictures(fresh)
    _same(_tables(store, "text", "vae"), _tables(fresh, "text", "vae"))


def _pictures(store) -> dict:
    with Store(store).reader("images") as r:
        return {k: (r.files(k), r.meta(k)["conversions"]) for k in r.keys()}
