"""Stores encoded before a fix, rerun with the fixed code: exactly the samples a fix changes are re-encoded, the
others carried forward, and the result equals a fresh build; a table no fix changes stays current (same version:
nothing downstream reruns). Before: the revisions were not bumped, so the old tables were reported up to date
and their wrong features reused silently.

- RGBA pictures (resize.keep_alpha) read by the Edit-Plus encoders as black where transparent (text.1 / vae.1);
- masks stretched by resize-bucket revision 1 (EXIF-rotated target): the latents' mask weights;
- Qwen-Image-2.1 prompts past the RoPE table, encoded by text21.1, now quarantined."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

import features.pictures
from pipeline.config import load_config
from stages.encode import qwen21
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from stages.encode.plan import NO_FIXES
from stages.resize import stage as resize_stage
from store import Store

from tests.stages.test_fix_revisions_resize import SMALL as MASK_SMALL
from tests.stages.test_fix_revisions_resize import _build_before_fix, _source
from tests.stages.test_fix_revisions_resize import revision_3_code  # noqa: F401,E402 - autouse: revision 3's fixes as made

F32 = {"encode_text.dtype": "float32", "encode_vae.dtype": "float32"}
ALPHA = {"resize.target_area": 64 * 64, "resize.control_vae_area": 64 * 64, "resize.control_vl_area": 64 * 64,
         "resize.multiple": 16, "resize.min_side": 16, "resize.val_fraction": 0.0, "resize.keep_alpha": True, **F32}


def _png(seed: int, transparent: bool) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (64, 64, 4), dtype=np.uint8)
    arr[..., 3] = 255
    if transparent:
        arr[:, :32] = 0  # left half: alpha 0 over black, as many editors save it
    b = io.BytesIO()
    Image.fromarray(arr if transparent else arr[..., :3], "RGBA" if transparent else "RGB").save(b, format="PNG")
    return b.getvalue()


def _alpha_source(root, transparent: tuple[bool, ...]) -> None:
    for d in ("target", "control"):
        (root / d).mkdir(parents=True)
    for i, t in enumerate(transparent):
        (root / "target" / f"s{i}.png").write_bytes(_png(i, t))
        (root / "target" / f"s{i}.txt").write_text(f"edit {i}")
        (root / "control" / f"s{i}.png").write_bytes(_png(100 + i, t))


def _encode_before_fix(monkeypatch, cfg, store, model, stages=(encode_text, encode_vae)):
    """What text.1 / vae.1 wrote: RGBA read as RGB by dropping the alpha, under the old revisions."""
    with monkeypatch.context() as m:
        m.setattr(features.pictures, "rgb_over_white", lambda im: im.convert("RGB"))
        m.setattr(encode_text, "FEATURE_REVISION", "text.1")
        m.setattr(encode_vae, "FEATURE_REVISION", "vae.1")
        for mod in (encode_text, encode_vae):
            m.setattr(mod, "FIXES", NO_FIXES)
        return [stage.run(cfg, store, model, batch_size=1) for stage in stages]


def _tables(store, *tables) -> dict:
    out = {}
    for table in tables:
        with Store(store).reader(table) as r:
            out[table] = {k: {n: t.clone() for n, t in r.get(k)["tensors"].items()} for k in r.keys()}
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for table in a:
        assert a[table].keys() == b[table].keys(), table
        for k in a[table]:
            for n in a[table][k]:
                assert torch.equal(a[table][k][n], b[table][k][n]), (table, k, n)


def test_the_rgba_fix_reencodes_exactly_the_samples_with_a_transparent_picture(tiny_plus_model, monkeypatch, tmp_path):
    cfg = load_config(None, ALPHA)
    _alpha_source(tmp_path / "src", (True, False, True, False, False))
    for store in ("store", "fresh"):
        resize_stage.run(cfg, tmp_path / "src", tmp_path / store)
    old_text, old_vae = _encode_before_fix(monkeypatch, cfg, tmp_path / "store", tiny_plus_model)

    for stage, old in ((encode_text, old_text), (encode_vae, old_vae)):
        s = stage.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
        assert not s.up_to_date and s.version == old.version + 1
        assert (s.encoded, s.reused) == (2, 3), stage.STAGE
        assert stage.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1).up_to_date

    for stage in (encode_text, encode_vae):
        stage.run(cfg, tmp_path / "fresh", tiny_plus_model, batch_size=1)
    _same(_tables(tmp_path / "store", "text", "vae"), _tables(tmp_path / "fresh", "text", "vae"))


def test_tables_no_fix_changes_stay_current(tiny_plus_model, monkeypatch, tmp_path):
    cfg = load_config(None, ALPHA)
    _alpha_source(tmp_path / "src", (False, False))
    resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    old = _encode_before_fix(monkeypatch, cfg, tmp_path / "store", tiny_plus_model)
    for stage, before in zip((encode_text, encode_vae), old):
        s = stage.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
        assert s.up_to_date and s.version == before.version, stage.STAGE
    # that scan's answer is kept with each version (store/reuse.py): the next rerun reads no row's metadata
    read = []
    for stage, before in zip((encode_text, encode_vae), old):
        monkeypatch.setattr(stage, "has_alpha_picture", lambda meta: read.append(meta) or False)
        s = stage.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
        assert s.up_to_date and s.version == before.version and read == [], stage.STAGE


def test_the_mask_fix_recomputes_exactly_the_mask_weights_of_turned_masks(tiny_plus_model, monkeypatch, tmp_path):
    """A turned mask changed the mask alone (its target rendered the same): the stored latents are kept and the
    mask weights computed from the mask now, as a fresh encode computes them. Before, the sample was encoded whole
    (its target and controls through the VAE again, for the same latents)."""
    cfg = load_config(None, {**MASK_SMALL, **F32})
    n = _source(tmp_path / "src", with_affected=True)
    _build_before_fix(monkeypatch, cfg, tmp_path / "src", tmp_path / "store")
    _encode_before_fix(monkeypatch, cfg, tmp_path / "store", tiny_plus_model)

    assert resize_stage.run(cfg, tmp_path / "src", tmp_path / "store").written == 1
    text = encode_text.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
    assert (text.encoded, text.reused) == (0, n)  # the text encoder reads no mask
    vae = encode_vae.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
    assert (vae.encoded, vae.completed, vae.reused) == (0, 1, n - 1)

    resize_stage.run(cfg, tmp_path / "src", tmp_path / "fresh")
    for stage in (encode_text, encode_vae):
        stage.run(cfg, tmp_path / "fresh", tiny_plus_model, batch_size=1)
    _same(_tables(tmp_path / "store", "text", "vae"), _tables(tmp_path / "fresh", "text", "vae"))
    with Store(tmp_path / "store").reader("vae") as r:
        assert sum("mask_weight" in r.get(k)["tensors"] for k in r.keys()) == 3


def test_the_21_caption_fix_drops_exactly_the_prompts_now_too_long(tiny_21_model, monkeypatch, tmp_path):
    from models import qwen21_text
    from tests.stages.test_qwen21_stages import SAMPLES, write_store21

    samples = [*SAMPLES[:3], ("paint it " * 60, (64, 64, "RGB"), [(64, 64, "RGB")])]
    cfg = load_config(None, F32)
    for store in ("store", "fresh"):
        write_store21(tmp_path / store, samples=samples)
    with monkeypatch.context() as m:  # text21.1: no caption-length check
        m.setattr(qwen21, "TEXT_REVISION", "text21.1")
        m.setattr(qwen21, "TEXT_FIXES", NO_FIXES)
        m.setattr(qwen21, "caption_length_rejection_21", lambda *a: None)
        old = encode_text.run(cfg, tmp_path / "store", tiny_21_model)
    assert old.encoded == len(samples)
    with Store(tmp_path / "store").reader("text") as r:
        at = {k: qwen21_text.target_frame_position(r.meta(k)["length"], [(h, w) for _, h, w in r.meta(k)["img_shapes"][1:]])
              for k in r.keys()}
    long_key = f"{len(samples) - 1:032x}"
    limit = max(v for k, v in at.items() if k != long_key) + 1
    assert at[long_key] >= limit
    monkeypatch.setattr(qwen21_text, "frame_positions", lambda: limit)  # a RoPE table the long prompt overruns

    s = encode_text.run(cfg, tmp_path / "store", tiny_21_model)
    assert (s.encoded, s.reused, s.quarantined) == (0, len(samples) - 1, 1)
    encode_text.run(cfg, tmp_path / "fresh", tiny_21_model)
    _same(_tables(tmp_path / "store", "text"), _tables(tmp_path / "fresh", "text"))


def test_a_21_text_table_without_prompts_too_long_stays_current(tiny_21_model, monkeypatch, tmp_path):
    from tests.stages.test_qwen21_stages import SAMPLES, write_store21

    cfg = load_config(None, F32)
    write_store21(tmp_path / "store", samples=SAMPLES[:3])
    with monkeypatch.context() as m:
        m.setattr(qwen21, "TEXT_REVISION", "text21.1")
        m.setattr(qwen21, "TEXT_FIXES", NO_FIXES)
        old = encode_text.run(cfg, tmp_path / "store", tiny_21_model)
    again = encode_text.run(cfg, tmp_path / "store", tiny_21_model)
    assert again.up_to_date and again.version == old.version


def _later_fix(monkeypatch, stage, rule) -> None:
    """A test-only fix of the stage's own made after its current revision: "<name>.n" -> "<name>.n+1", `rule`
    appended to its list (it reads the images' caption)."""
    from dataclasses import replace

    name, _, n = stage.FEATURE_REVISION.rpartition(".")
    fixes = stage.FIXES
    monkeypatch.setattr(stage, "FEATURE_REVISION", f"{name}.{int(n) + 1}")
    monkeypatch.setattr(stage, "FIXES", replace(fixes, own=(*fixes.own, (int(n), rule)),
                                                reads=(*fixes.reads, "caption")))


def test_a_table_two_own_revisions_behind_redoes_the_rows_either_later_fix_changes(tiny_plus_model, monkeypatch,
                                                                                   tmp_path):
    """text.1 / vae.1 under a third revision: the union of the rows the RGBA fix (s0, s2) and the next one (s2, s3)
    change is encoded again; a text.2 / vae.2 table only the next one's rows. Before, an encoder kept one earlier
    revision: the next fix re-encoded every row of a table two revisions behind."""
    cfg = load_config(None, ALPHA)
    _alpha_source(tmp_path / "src", (True, False, True, False, False))
    for store in ("two", "one"):
        resize_stage.run(cfg, tmp_path / "src", tmp_path / store)
    _encode_before_fix(monkeypatch, cfg, tmp_path / "two", tiny_plus_model)
    for stage in (encode_text, encode_vae):
        stage.run(cfg, tmp_path / "one", tiny_plus_model, batch_size=1)
        _later_fix(monkeypatch, stage, lambda meta, row: meta.get("caption") in ("edit 2", "edit 3"))

    for stage in (encode_text, encode_vae):
        two = stage.run(cfg, tmp_path / "two", tiny_plus_model, batch_size=1)
        assert (two.encoded, two.reused) == (3, 2), stage.STAGE
        one = stage.run(cfg, tmp_path / "one", tiny_plus_model, batch_size=1)
        assert (one.encoded, one.reused) == (2, 3), stage.STAGE
        assert stage.run(cfg, tmp_path / "two", tiny_plus_model, batch_size=1).up_to_date
    _same(_tables(tmp_path / "two", "text", "vae"), _tables(tmp_path / "one", "text", "vae"))


def test_a_table_two_own_revisions_behind_that_no_later_fix_changes_stays_current(tiny_plus_model, monkeypatch,
                                                                                  tmp_path):
    cfg = load_config(None, ALPHA)
    _alpha_source(tmp_path / "src", (False, False))
    resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    old = _encode_before_fix(monkeypatch, cfg, tmp_path / "store", tiny_plus_model)
    for stage, before in zip((encode_text, encode_vae), old):
        _later_fix(monkeypatch, stage, lambda meta, row: meta.get("caption") == "edit 9")
        s = stage.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
        assert s.up_to_date and s.version == before.version, stage.STAGE
