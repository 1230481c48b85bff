"""A recaption changes a sample's key (the key hashes the caption) but not its pictures: encode-vae carries its
latents from the earlier row of the same pictures (same source bytes, mask, rendered sizes, feature lineage)
instead of encoding them again (before: every recaptioned sample through the VAE, hours at 1M); a changed
target is still encoded."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from pipeline.config import load_config
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from stages.resize import stage as resize_stage
from store import Store

from tests.stages.test_encode_text_carry import SMALL, _source
from tests.stages.test_fix_revisions_encode import _same, _tables

CAPTIONS = ("edit 0", "make the sky red", "add a hat")
META = ("img_shapes", "latent_shapes", "num_controls", "has_mask", "mask_sha256", "split")


def _mask(src, seed: int) -> None:
    (src / "mask").mkdir(exist_ok=True)
    arr = (np.random.default_rng(seed).random((64, 64)) > 0.5).astype(np.uint8) * 255
    Image.fromarray(arr, mode="L").save(src / "mask" / "s0.png")


def _meta(store) -> dict[str, dict]:
    with Store(store).reader("vae") as r:
        return {k: {c: r.meta(k)[c] for c in META} for k in r.keys()}


def test_a_recaption_carries_the_latents_and_a_new_target_is_encoded(tiny_edit_model, tmp_path):
    src, store, fresh = tmp_path / "src", tmp_path / "store", tmp_path / "fresh"
    _source(src, CAPTIONS)
    _mask(src, seed=1)
    cfg = load_config(None, SMALL)
    resize_stage.run(cfg, src, store)
    for stage in (encode_text, encode_vae):
        stage.run(cfg, store, tiny_edit_model, batch_size=2)
    before = Store(store).tables()["vae"]
    with Store(store).reader("vae", before) as r:
        old = {k: {n: t.clone() for n, t in r.get(k)["tensors"].items()} for k in r.keys()}

    (src / "target" / "s0.txt").write_text("edit 0, again")  # s0: the one with a mask
    (src / "target" / "s1.txt").write_text("make the sky a deep red")
    assert resize_stage.run(cfg, src, store).written == 2
    assert encode_text.run(cfg, store, tiny_edit_model, batch_size=2).encoded == 2  # the text changed
    vae = encode_vae.run(cfg, store, tiny_edit_model, batch_size=2)
    assert not vae.up_to_date and (vae.encoded, vae.reused) == (0, len(CAPTIONS))
    now = _tables(store, "vae")["vae"]
    new_keys, old_keys = now.keys() - old.keys(), old.keys() - now.keys()
    assert len(new_keys) == len(old_keys) == 2
    names = {frozenset(t) for t in now.values()}
    assert names == {frozenset({"target", "control_0"}), frozenset({"target", "control_0", "mask_weight"})}
    # each new key holds, bit for bit, the latents of the old key of its pictures (the masked one: its weights)
    for new_key in new_keys:
        (old_key,) = [k for k in old_keys if old[k].keys() == now[new_key].keys()]
        for n, t in old[old_key].items():
            assert now[new_key][n].dtype == t.dtype and torch.equal(now[new_key][n], t), n

    resize_stage.run(cfg, src, fresh)  # a fresh encode of the recaptioned dataset: the very same table
    encode_vae.run(cfg, fresh, tiny_edit_model, batch_size=2)
    _same(_tables(store, "vae"), _tables(fresh, "vae"))
    assert _meta(store) == _meta(fresh)

    # other pixels under a caption seen before: encoded (only the pictures carry, never the caption)
    arr = np.random.default_rng(7).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(arr).save(src / "target" / "s2.png")
    assert resize_stage.run(cfg, src, store).written == 1
    vae = encode_vae.run(cfg, store, tiny_edit_model, batch_size=2)
    assert (vae.encoded, vae.reused) == (1, len(CAPTIONS) - 1)
    assert encode_vae.run(cfg, store, tiny_edit_model, batch_size=2).up_to_date

    # a recaption with another mask: the latents' pictures are the same but the mask weights are not
    (src / "target" / "s0.txt").write_text("edit 0, once more")
    _mask(src, seed=2)
    assert resize_stage.run(cfg, src, store).written == 1
    vae = encode_vae.run(cfg, store, tiny_edit_model, batch_size=2)
    assert (vae.encoded, vae.reused) == (1, len(CAPTIONS) - 1)



def test_the_vectorised_prefilter_keeps_exactly_the_rows_holding_the_cells_wanted():
    """`_rows_holding` narrows an images manifest to the rows whose stored cells are the wanted ones, for the list
    cells the images table stores, for JSON text cells, and - where the types differ - keeps every row for the
    per-row compare."""
    import pyarrow as pa

    from stages.encode.same_inputs import _rows_holding

    cells = [["a0", "b0"], ["a1"], None, ["a2", "b2"]]
    lists = pa.table({"key": ["k0", "k1", "k2", "k3"], "source_hashes": pa.array(cells, pa.list_(pa.string()))})
    assert _rows_holding(lists, [["a2", "b2"], ["a1"], None]).column("key").to_pylist() == ["k1", "k3"]
    assert _rows_holding(lists, [["a0"]]).num_rows == 0  # a prefix of a cell is another cell
    text = pa.table({"key": ["k0", "k1"], "source_hashes": ['["a0", "b0"]', '["a1"]']})
    assert _rows_holding(text, ['["a1"]']).column("key").to_pylist() == ["k1"]
    assert _rows_holding(text, [["a1"]]).num_rows == 2  # cells of another type: all kept, compared row by row


def test_an_earlier_images_version_whose_manifest_page_does_not_decode_is_recorded_as_damaged(tmp_path):
    """encode-vae's look for a recaptioned sample's earlier pictures skips an older images version it cannot read;
    before, without recording it (reuse's and the reader's view record theirs), so it was never marked damaged."""
    from damage import damage_manifest_page
    from stages.encode.same_inputs import _earlier_keys
    from store import format as fmt

    src, store = tmp_path / "src", tmp_path / "store"
    _source(src, CAPTIONS)
    cfg = load_config(None, SMALL)
    resize_stage.run(cfg, src, store)
    (src / "target" / "s1.txt").write_text("make the sky a deep red")
    resize_stage.run(cfg, src, store)
    assert Store(store).tables()["images"] == 2
    damage_manifest_page(Store(store).version_dir("images", 1), "key", group=0)
    assert _earlier_keys(Store(store), set(), [], {"x"}) == {}
    assert "unreadable" in fmt.damaged_marker(store, "images", 1).read_text()
