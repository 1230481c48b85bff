"""A store rendered by resize-bucket revision 2 (or 1: two revisions behind) rerun with revision 3: exactly the
samples revision 3 renders differently are rendered again - a mask of another aspect than its target (stretched
then, bad-mask now: its next copy kept instead), a caption holding control characters or CR (cleaned now, so
keyed anew), a copy kept instead of its rejected first copy (stored with caption '' then) - and every resized mask
(the rows record no mask size: a superset, rendered to the same bytes); the encoders encode again only the samples
whose pictures or instruction changed (text: not the copy kept instead of a key whose caption was right; vae: not
the copy kept instead with the mask it had); everything else is carried bit for bit, and the store equals a fresh one.
Before: revision 2 tables were reported up to date and their stretched masks, dirty captions and empty revived
captions encoded and trained on silently."""

from __future__ import annotations

import io
import numpy as np
import pytest
from PIL import Image

from pipeline.config import load_config
from stages.encode import text as encode_text
from stages.encode import vae as encode_vae
from stages.resize import images_table, judge, known_sources, render_loop, rendering, run_lineage
from stages.resize import stage as resize_stage
from store import Store

from tests.stages.test_fix_revisions_encode import F32, _same, _tables
from tests.stages.test_fix_revisions_resize import SMALL, _contents
from tests.stages.test_fix_revisions_resize import revision_3_code  # noqa: F401,E402 - autouse: revision 3's fixes as made


def _equals_a_fresh_store_and_up_to_date(cfg, tmp_path, model, features) -> None:
    """The rerun store (tmp_path/store, from tmp_path/src) equals one built afresh, pictures and features, and
    every stage then says it is up to date."""
    resize_stage.run(cfg, tmp_path / "src", tmp_path / "fresh")
    for stage in (encode_text, encode_vae):
        stage.run(cfg, tmp_path / "fresh", model, batch_size=1)
    assert _contents(tmp_path / "store") == _contents(tmp_path / "fresh")
    _same(features, _tables(tmp_path / "fresh", "text", "vae"))
    assert resize_stage.run(cfg, tmp_path / "src", tmp_path / "store").up_to_date
    for stage in (encode_text, encode_vae):
        assert stage.run(cfg, tmp_path / "store", model, batch_size=1).up_to_date


def _png(seed: int, width: int = 96, height: int = 64) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(arr).save(b, format="PNG")
    return b.getvalue()


def _mask(width: int, height: int, part: int = 3) -> bytes:
    arr = np.zeros((height, width), np.uint8)
    arr[: height // part] = 255
    b = io.BytesIO()
    Image.fromarray(arr, "L").save(b, format="PNG")
    return b.getvalue()


def _source(root) -> None:
    for d in ("target", "mask"):
        (root / d).mkdir(parents=True)
    samples = {f"plain{i}": (_png(i), None, f"edit {i}") for i in range(3)}
    samples["masked"] = (_png(5), _mask(96, 64), "mask it")  # a mask of its target's size: unchanged
    samples["resized"] = (_png(6), _mask(48, 32), "half mask")  # resized, of its aspect: rendered alike again
    samples["ctrl"] = (_png(7), None, "\x1b[31mred\x1b[0m sky")  # an ANSI colour a captioning script logged
    samples["crlf"] = (_png(8), None, "line one\r\nline two")
    samples["misfit"] = (_png(9), _mask(64, 64), "square mask")  # a square mask on a 3:2 target: was stretched
    samples["misfit_dup"] = (_png(9), _mask(96, 64, 2), "square mask")  # its copy with a fitting mask: kept now
    samples["revived"] = (_png(10), b"not a png", "bad mask")  # rejected: its copy was stored with caption ''
    samples["revived_dup"] = (_png(10), _mask(96, 64), "bad mask")
    for stem, (target, mask, caption) in samples.items():
        (root / "target" / f"{stem}.png").write_bytes(target)
        (root / "target" / f"{stem}.txt").write_bytes(caption.encode())
        if mask is not None:
            (root / "mask" / f"{stem}.png").write_bytes(mask)


def _old_caption(raw: bytes) -> str:  # before cc89fbf
    return raw.decode("utf-8").lstrip("\ufeff").strip()


def _build_at(monkeypatch, revision: int, cfg, src, store):
    """What revision 1 or 2 wrote: any mask stretched, captions as read, a kept copy's caption '', no notes of
    either; revision 2 recorded the lineage before its fix as one string each, revision 1 none."""
    with monkeypatch.context() as m:
        m.setattr(images_table, "FEATURE_REVISION", revision)
        m.setattr(rendering, "_check_mask_aspect", lambda *a: None)
        if revision == 1:
            m.setattr(rendering, "_drawn_on_stored_pixels", lambda *a: False)
        for mod in (judge, render_loop, known_sources):
            m.setattr(mod, "clean_caption", _old_caption)
        m.setattr(rendering, "had_controls", lambda raw: False)
        m.setattr(render_loop, "_kept_instead", lambda out: out, raising=False)  # no note
        real_revive = render_loop._revive

        def old_revive(*a, **k):  # the copy kept instead rendered with caption ''
            with pytest.MonkeyPatch.context() as r:
                r.setattr(render_loop, "clean_caption", lambda raw: "")
                return real_revive(*a, **k)

        m.setattr(render_loop, "_revive", old_revive)
        real_schema = run_lineage.images_schema

        def old_schema(*a, **k):
            schema = real_schema(*a, **k)
            attrs = {n: v for n, v in schema.attrs.items()
                     if n not in ("feature_lineage_before_fixes", "code_version_before_fixes")}
            if revision == 2:
                attrs |= {n: schema.attrs[n][0] for n in ("feature_lineage_before_fixes", "code_version_before_fixes")}
            return type(schema)(name=schema.name, lineage=schema.lineage, fields=schema.fields, attrs=attrs)

        m.setattr(run_lineage, "images_schema", old_schema)
        return resize_stage.run(cfg, src, store)


def _by_caption(store, version: int | None = None) -> dict:
    st = Store(store)
    with st.reader("images", version) as r:
        return {r.meta(k)["caption"]: (k, r.files(k)) for k in r.keys()}


@pytest.mark.parametrize("revision", [2, 1])
def test_revision_3_renders_and_encodes_again_exactly_what_it_changed(tiny_plus_model, monkeypatch, tmp_path,
                                                                       revision):
    cfg = load_config(None, {**SMALL, **F32})
    _source(tmp_path / "src")
    old = _build_at(monkeypatch, revision, cfg, tmp_path / "src", tmp_path / "store")
    before = _by_caption(tmp_path / "store")
    assert {"\x1b[31mred\x1b[0m sky", "line one\r\nline two", "", "square mask"} <= before.keys()  # '': "bad mask"
    old_text, old_vae = (stage.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
                         for stage in (encode_text, encode_vae))
    old_features = _tables(tmp_path / "store", "text", "vae")

    rerun = resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    assert not rerun.up_to_date and rerun.version == old.version + 1
    # ctrl, crlf (new keys), misfit_dup, revived_dup (kept instead), resized (the superset); the rest carried
    assert (rerun.written, rerun.reused) == (5, 4)
    after = _by_caption(tmp_path / "store")
    assert "" not in after and {"red sky", "line one\nline two", "bad mask", "square mask"} <= after.keys()
    for caption in ("edit 0", "edit 1", "edit 2", "mask it", "half mask"):  # carried (or rendered alike): same bytes
        assert after[caption] == before[caption]
    assert after["square mask"][0] == before["square mask"][0] and after["square mask"][1] != before["square mask"][1]

    text = encode_text.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
    vae = encode_vae.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
    # the two new keys and one copy kept instead each: text the one stored with caption '' (revived_dup; its prompt
    # was the empty one), vae the one with another mask (misfit_dup: its latents kept, its mask weights computed,
    # stages/encode/mask_only.py); before, both copies in both (one needlessly)
    assert (text.version, text.encoded, text.reused) == (old_text.version + 1, 3, 6)
    assert (vae.version, vae.encoded, vae.completed, vae.reused) == (old_vae.version + 1, 2, 1, 6)
    new_features = _tables(tmp_path / "store", "text", "vae")
    for caption in ("edit 0", "edit 1", "edit 2", "mask it", "half mask"):
        key = after[caption][0]
        _same(*({t: {key: tables[t][key]} for t in tables} for tables in (old_features, new_features)))

    _equals_a_fresh_store_and_up_to_date(cfg, tmp_path, tiny_plus_model, new_features)


def test_a_revision_2_table_revision_3_leaves_unchanged_stays_current(tiny_plus_model, monkeypatch, tmp_path):
    cfg = load_config(None, {**SMALL, **F32})
    _source(tmp_path / "src")
    for stem in ("resized", "ctrl", "crlf", "misfit", "misfit_dup", "revived", "revived_dup"):
        for f in (tmp_path / "src").rglob(f"{stem}.*"):
            f.unlink()
    old = _build_at(monkeypatch, 2, cfg, tmp_path / "src", tmp_path / "store")
    encoded = [stage.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1) for stage in (encode_text, encode_vae)]
    again = resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    assert again.up_to_date and again.version == old.version  # nothing downstream reruns
    for stage, before in zip((encode_text, encode_vae), encoded):
        s = stage.run(cfg, tmp_path / "store", tiny_plus_model, batch_size=1)
        assert s.up_to_date and s.version == before.version, stage.STAGE


def test_repair_of_images_rendered_by_revision_2(monkeypatch, tmp_path):
    """A damaged shard of a version revision 2 rendered: the repair re-renders its samples with this code, so it
    writes them under revision 3's lineage, re-rendering what revision 3 changes too, and the next run is up to
    date. Before, it wrote them under revision 2's lineage (its one-string record of revision 1), and the next run
    re-rendered 4 or 5 samples again, the repaired ones among them."""
    from tests.stages.test_fix_revisions_repair import _config_file, _damage_shards_of, runner

    from damage import key_at
    from pipeline.cli import app
    from store.verify import verify_store

    settings = {**SMALL, "resize.shard_size_mb": 0.01}
    cfg, config = load_config(None, settings), _config_file(tmp_path / "c.yaml", settings)
    _source(tmp_path / "src")
    _build_at(monkeypatch, 2, cfg, tmp_path / "src", tmp_path / "store")
    _damage_shards_of(tmp_path / "store", "images", key_at(tmp_path / "store", "images", 0))
    res = runner.invoke(app, ["store", "repair", str(tmp_path / "store"), "--config", str(config)])
    assert res.exit_code == 0, res.output
    assert verify_store(tmp_path / "store", progress=False) == []
    rerun = resize_stage.run(cfg, tmp_path / "src", tmp_path / "store")
    assert (rerun.up_to_date, rerun.written) == (True, 0)
    resize_stage.run(cfg, tmp_path / "src", tmp_path / "fresh")
    assert _contents(tmp_path / "store") == _contents(tmp_path / "fresh")
