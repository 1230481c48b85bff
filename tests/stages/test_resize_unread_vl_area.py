"""resize.control_vl_area sizes the VL views alone: under resize.vl_views false (the Qwen-Image-2.1 config) no picture
reads it, so a change to it keeps the images table (before: a new version, every picture rendered again into the
same bytes); with VL views it is read (a new version). A table made before, with it hashed as set, is carried."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.demo_data import make_demo_data
from schemas.config import ResizeConfig
from schemas.errors import UserError
from schemas.lineage import FEATURES, Role
from stages.resize.stage import run
from store import Store

QWEN21 = Path(__file__).parents[2] / "configs" / "qwen-image-2.1.yaml"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vl-area") / "src"
    make_demo_data(out, n=4, max_controls=2, seed=0)
    return out


def _resize(source: Path, store: Path, **settings):
    cfg = load_config(QWEN21, {"resize.val_fraction": 0.25, **{f"resize.{k}": v for k, v in settings.items()}})
    return run(cfg, source, store)


def test_control_vl_area_is_no_setting_without_vl_views(source, tmp_path):
    store = tmp_path / "store"
    first = _resize(source, store)
    assert first.written == 4
    again = _resize(source, store, control_vl_area=4096)
    assert again.up_to_date and Store(store).tables()["images"] == 1
    # with VL views it sizes pictures: another table
    views = tmp_path / "views"
    _resize(source, views, vl_views=True)
    resized = _resize(source, views, vl_views=True, control_vl_area=4096)
    assert not resized.up_to_date and resized.written == 4 and Store(views).tables()["images"] == 2


def test_a_table_made_with_it_hashed_as_set_is_carried_not_rendered(source, tmp_path, monkeypatch):
    """A table made before (control_vl_area hashed whatever vl_views): a new version, its pictures carried."""
    store = tmp_path / "store"
    metadata = ResizeConfig.model_fields["control_vl_area"].metadata
    monkeypatch.setattr(ResizeConfig.model_fields["control_vl_area"], "metadata",
                        [FEATURES if isinstance(m, Role) else m for m in metadata])
    assert _resize(source, store, control_vl_area=4096).written == 4
    monkeypatch.undo()
    from schemas import pictures_lineage

    spelled, real = [], pictures_lineage.earlier_pictures_lineage
    monkeypatch.setattr(pictures_lineage, "earlier_pictures_lineage", lambda *a: spelled.append(1) or real(*a))
    again = _resize(source, store, control_vl_area=4096)
    assert again.written == 0 and again.reused == 4
    assert len(spelled) == 1  # the earlier spelling hashed once a run, for the keys to carry and their rows


def test_the_encoders_read_such_a_table_as_the_same_pictures():
    """What an encoder read of a version recorded with control_vl_area as set (VL views off) is what it reads of
    one recorded now: its features are carried (before the fix: None, the whole lineage compared, re-encoded)."""
    from schemas.pictures_lineage import TEXT_UNREAD, VAE_UNREAD, images_code_version, pictures_lineage, read_lineage

    rc = ResizeConfig(vl_views=False, control_vl_area=4096)
    code = images_code_version(1)
    recorded = {"now": pictures_lineage(rc, code), "before": pictures_lineage(rc, code, as_set=True)}
    assert recorded["now"] != recorded["before"]
    settings = rc.model_dump(mode="json")
    for unread in (VAE_UNREAD, TEXT_UNREAD["qwen-image-2.1"]):
        read = {k: read_lineage(settings, lineage, code, unread) for k, lineage in recorded.items()}
        assert read["now"] is not None and read["now"] == read["before"]


def test_a_switch_to_the_pictures_split_past_such_a_table_without_hashes_is_refused_before_rendering(
        source, tmp_path, monkeypatch):
    """Such a table (its lineage the earlier spelling), split by key by a release that recorded no source_hashes:
    a switch to the pictures split carries its pictures with no identity to split them by. The check before
    rendering looked for this run's spelling only, so the refusal came after the whole source was read and
    rendered (in `carried.carry_samples`); now before, naming the version's samples."""
    from stages.resize import stage
    from test_resize_split_rule import _as_written_without_source_hashes

    store = tmp_path / "store"
    metadata = ResizeConfig.model_fields["control_vl_area"].metadata
    monkeypatch.setattr(ResizeConfig.model_fields["control_vl_area"], "metadata",
                        [FEATURES if isinstance(m, Role) else m for m in metadata])
    old = _resize(source, store, control_vl_area=4096, split_by="key")
    monkeypatch.undo()
    _as_written_without_source_hashes(Store(store).version_dir("images", old.version))
    rendering, real = [], stage.render_source
    monkeypatch.setattr(stage, "render_source", lambda *a, **k: rendering.append(1) or real(*a, **k))
    with pytest.raises(UserError) as e:
        _resize(source, store, control_vl_area=4096, split_by="pictures")
    assert f"table 'images' v{old.version}" in str(e.value), e.value
    assert "did not record source_hashes (4 of its samples)" in str(e.value), e.value
    assert rendering == []  # refused before the source was read
