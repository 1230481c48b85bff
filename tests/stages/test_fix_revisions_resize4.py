"""A store rendered by resize-bucket revision 3 rerun with revision 4, which takes a picture's one transparent colour
(a PNG's tRNS chunk on an RGB or grey picture) as alpha: no stored column tells such a picture, so every sample's
source pictures' headers are read, and only the samples with one are rendered again (the others carried); the encoders encode again only the samples whose new row notes the
transparent colour, carry the rest bit for bit, and the store equals a fresh one. Before: revision 3 tables were
reported up to date and their cut-outs' transparent pixels trained on in their stored colour (black)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from features import decode
from pipeline.config import load_config
from schemas.fixes import TRANSPARENT_COLOUR
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from stages.resize import images_table
from stages.resize import stage as resize_stage

from tests.stages.test_fix_revisions_encode import F32, _same, _tables
from tests.stages.test_fix_revisions_resize import SMALL, _contents
from tests.stages.test_fix_revisions_resize3 import _by_caption, _equals_a_fresh_store_and_up_to_date, _png


def _keyed(seed: int) -> bytes:
    """An RGBA cut-out as PNG optimizers store it: RGB, its transparent pixels black, tRNS naming black."""
    arr = np.random.default_rng(seed).integers(1, 255, (64, 96, 3), dtype=np.uint8)
    arr[:, :40] = 0
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format="PNG", transparency=(0, 0, 0))
    return b.getvalue()


def _source(root) -> None:
    (root / "target").mkdir(parents=True)
    pictures = {f"plain{i}": _png(i) for i in range(3)} | {"cutout": _keyed(7)}
    for stem, data in pictures.items():
        (root / "target" / f"{stem}.png").write_bytes(data)
        (root / "target" / f"{stem}.txt").write_text(f"edit {stem}")


def _build_at_revision_3(monkeypatch, cfg, src, store):
    with monkeypatch.context() as m:
        m.setattr(images_table, "FEATURE_REVISION", 3)
        m.setattr(images_table, "FIXES", tuple((r, f) for r, f in images_table.FIXES if r < 3))
        m.setattr(decode, "_colour_keyed", lambda im: None)  # revision 3's decode: the colour kept as stored
        return resize_stage.run(cfg, src, store)


def test_revision_4_renders_again_and_encodes_again_only_the_cutout(tiny_plus_model, monkeypatch, tmp_path):
    cfg = load_config(None, {**SMALL, **F32})
    _source(tmp_path / "src")
    old = _build_at_revision_3(monkeypatch, cfg, tmp_path / "src", tmp_path / "store")
    before = _by_caption(tmp_path / "store")
    old_text, old_vae = (stage.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
                         for stage in (encode_text, encode_vae))
    old_features = _tables(tmp_path / "store", "text", "vae")

    rerun = resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    assert not rerun.up_to_date and rerun.version == old.version + 1
    # the cut-out alone rendered again: its header names a transparent colour; the others carried (all 4 rendered
    # before: no stored column tells such a picture)
    assert (rerun.written, rerun.reused) == (1, 3)
    after = _by_caption(tmp_path / "store")
    for caption in ("edit plain0", "edit plain1", "edit plain2"):
        assert after[caption] == before[caption]  # rendered to the same bytes
    key, files = after["edit cutout"]
    assert key == before["edit cutout"][0] and files != before["edit cutout"][1]
    target = np.asarray(Image.open(io.BytesIO(files["target.png"])))
    assert target[:, :30].min() == 255  # the transparent side white, as the RGBA picture's; black before

    text = encode_text.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
    vae = encode_vae.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
    assert (text.version, text.encoded, text.reused) == (old_text.version + 1, 1, 3)
    assert (vae.version, vae.encoded, vae.reused) == (old_vae.version + 1, 1, 3)
    new_features = _tables(tmp_path / "store", "text", "vae")
    for caption in ("edit plain0", "edit plain1", "edit plain2"):
        k = after[caption][0]
        _same(*({t: {k: tables[t][k]} for t in tables} for tables in (old_features, new_features)))

    _equals_a_fresh_store_and_up_to_date(cfg, tmp_path, tiny_plus_model, new_features)


def test_the_cutout_row_notes_the_transparent_colour(tmp_path):
    cfg = load_config(None, SMALL)
    _source(tmp_path / "src")
    resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    from store import Store

    with Store(tmp_path / "store").reader("images") as r:
        notes = {r.meta(k)["caption"]: r.meta(k)["conversions"] for k in r.keys()}
    assert notes["edit cutout"] == [f"RGB {TRANSPARENT_COLOUR}, composited over white"]
    assert notes["edit plain0"] == []


def test_under_keep_alpha_the_cutout_is_stored_with_its_alpha(tmp_path):
    cfg = load_config(None, {**SMALL, "resize.keep_alpha": True})
    _source(tmp_path / "src")
    resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    stored = {caption: Image.open(io.BytesIO(files["target.png"])) for caption, (_, files) in
              _by_caption(tmp_path / "store").items()}
    assert stored["edit plain0"].mode == "RGB" and stored["edit cutout"].mode == "RGBA"
    alpha = np.asarray(stored["edit cutout"])[..., 3]
    assert alpha[:, :30].max() == 0 and alpha[:, -30:].min() == 255  # dropped (RGB, black there) before


def test_every_encoder_encodes_again_a_sample_noting_the_transparent_colour_of_a_revision_3_table():
    """Edit, Edit-Plus and Qwen-Image-2.1 alike (2.1's VAE reads the RGBA picture kept, its VLM the references)."""
    from stages.encode import qwen21
    from stages.encode.plan import _images_fixes_since

    keyed = {"conversions": [f"RGB {TRANSPARENT_COLOUR}, kept with its alpha (RGBA)"], "img_shapes": [[1, 4, 6]]}
    plain = {"conversions": ["L converted to RGB"], "img_shapes": [[1, 4, 6]]}
    row = {"length": 10, "empty_length": 8}
    for name, fixes in {"text": encode_text.FIXES, "vae": encode_vae.FIXES, "text21": qwen21.TEXT_FIXES,
                        "vae21": qwen21.VAE_FIXES}.items():
        rules = _images_fixes_since(fixes, 3)
        assert "conversions" in fixes.reads, name
        assert any(rule(keyed, row) for rule in rules), name
        assert not any(rule(plain, row) for rule in rules), name


def test_a_webdataset_source_whose_control_has_a_transparent_colour(monkeypatch, tmp_path):
    """Tars carried unread on a rerun (known_tars.py) are read whole instead, each sample's pictures' headers read:
    a control's transparent colour counts as a target's; the sample without one in the same tar is carried."""
    import tarfile

    cfg = load_config(None, SMALL)
    src = tmp_path / "src"
    src.mkdir()
    tars = {"a.tar": {"s0": {"png": _png(0), "txt": b"edit s0"}, "s1": {"png": _png(1), "txt": b"edit s1"}},
            "b.tar": {"s2": {"png": _png(2), "control.png": _keyed(8), "txt": b"edit s2"},
                      "s3": {"png": _png(3), "control.png": _png(4), "txt": b"edit s3"}}}
    for name, samples in tars.items():
        with tarfile.open(src / name, "w", format=tarfile.USTAR_FORMAT) as tf:
            for stem, members in samples.items():
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"{stem}.{ext}")
                    info.size, info.mtime = len(data), 0
                    tf.addfile(info, io.BytesIO(data))
    old = _build_at_revision_3(monkeypatch, cfg, src, tmp_path / "store")
    assert old.written == 4
    before = _by_caption(tmp_path / "store")

    rerun = resize_stage.run(cfg, src, tmp_path / "store")
    assert (rerun.written, rerun.reused) == (1, 3)  # (4, 0) before: every sample rendered again
    after = _by_caption(tmp_path / "store")
    assert after["edit s2"][1]["control_0.png"] != before["edit s2"][1]["control_0.png"]
    assert all(after[c] == before[c] for c in ("edit s0", "edit s1", "edit s3"))
    resize_stage.run(cfg, src, tmp_path / "fresh")
    assert _contents(tmp_path / "store") == _contents(tmp_path / "fresh")
    assert resize_stage.run(cfg, src, tmp_path / "store").up_to_date
