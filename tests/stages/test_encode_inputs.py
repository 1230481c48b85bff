"""Encode stages and their inputs: a rebuilt `images` table is never mistaken for the old one (version numbers
restart at 1 after a table folder is deleted), and a run whose every sample is rejected fails instead of
committing an empty table."""

from __future__ import annotations

import shutil

import pytest

from schemas.config import PipelineConfig
from schemas.errors import UserError
from stages.encode import text as encode_text, vae as encode_vae
from store import Store


def test_rebuilt_images_table_with_the_same_version_number_is_reencoded(tiny_plus_model, tmp_path, images_fixture):
    write_images_table, FixtureSample = images_fixture.write, images_fixture.Sample
    store = tmp_path / "store"
    write_images_table(store, [FixtureSample("a", (64, 64), [(64, 64)], [(64, 64)])], seed=0, tag="a")
    first = encode_vae.run(PipelineConfig(), store, tiny_plus_model)
    assert not first.up_to_date
    shutil.rmtree(store / "images")  # the user deletes the table and rebuilds it from other data
    write_images_table(store, [FixtureSample("b", (64, 96), [], [])], seed=1, tag="a")
    st = Store(store)
    assert st.tables()["images"] == 1  # same number, other contents
    second = encode_vae.run(PipelineConfig(), store, tiny_plus_model)
    assert not second.up_to_date and second.version == 2
    assert st.reader("vae").keys() == st.reader("images").keys()


def test_every_sample_rejected_is_an_error_and_no_empty_table(tiny_edit_model, tmp_path, images_fixture):
    write_images_table, FixtureSample = images_fixture.write, images_fixture.Sample
    store = tmp_path / "store"
    # an Edit model needs exactly one control: both samples are rejected
    write_images_table(store, [FixtureSample("two", (64, 64), [(64, 64)] * 2, [(64, 64)] * 2),
                               FixtureSample("none", (64, 64), [], [])])
    with pytest.raises(UserError, match="would be empty"):
        encode_text.run(PipelineConfig(), store, tiny_edit_model)
    st = Store(store)
    assert "text" not in st.tables()
    assert len(st.quarantine()) == 2  # the reasons are kept
    # the version it began is gone (it left v1 with its rank-done files: the fixed run below committed v2, and v1
    # stayed an incomplete version until `store gc`)
    assert not list((store / "text").glob("v*")) and not list((store / "text").glob(".v*"))
    write_images_table(store, [FixtureSample("one", (64, 64), [(64, 64)], [(64, 64)])], tag="b")  # fixed inputs
    assert encode_text.run(PipelineConfig(), store, tiny_edit_model).version == 1


def test_caption_with_the_image_placeholder_token_is_quarantined_not_fatal(tiny_plus_model, tmp_path, images_fixture):
    write_images_table, FixtureSample = images_fixture.write, images_fixture.Sample
    store = tmp_path / "store"
    write_images_table(store, [FixtureSample("make it <|image_pad|> red", (64, 64), [(64, 64)], [(64, 64)]),
                               FixtureSample("make it red", (64, 64), [(64, 64)], [(64, 64)])])
    summary = encode_text.run(PipelineConfig(), store, tiny_plus_model)
    assert summary.encoded == 1 and summary.quarantined == 1
    rows = Store(store).quarantine().to_pylist()
    assert rows[0]["reason"] == "prompt does not fit the template"


@pytest.mark.parametrize("stage", [encode_text, encode_vae])
def test_samples_the_model_refuses_for_their_control_count_are_quarantined_unread(stage, tiny_edit_model, tmp_path,
                                                                                  images_fixture, monkeypatch):
    """An Edit model takes one control: the others are refused from the manifest's num_controls, their files never
    read (an Edit model over an Edit-Plus dataset read and checked every byte, hours at 1M samples, to quarantine
    each one). The quarantine rows and the table are the same as when they were read first."""
    from store.reader import TableReader

    write_images_table, FixtureSample = images_fixture.write, images_fixture.Sample
    store = tmp_path / "store"
    keys = write_images_table(store, [FixtureSample("two", (64, 64), [(64, 64)] * 2, [(64, 64)] * 2),
                                      FixtureSample("one", (64, 64), [(64, 64)], [(64, 64)]),
                                      FixtureSample("none", (64, 64), [], [])])
    one = next(k for k, s in keys.items() if s.caption == "one")
    real, read = TableReader.get, []
    monkeypatch.setattr(TableReader, "get", lambda self, key: read.append((self.table, key)) or real(self, key))
    summary = stage.run(PipelineConfig(), store, tiny_edit_model)
    assert summary.encoded == 1 and summary.quarantined == 2
    assert [k for t, k in read if t == "images"] == [one]  # the refused samples' bytes were not read
    rows = Store(store).quarantine().to_pylist()
    assert sorted(r["key"] for r in rows) == sorted(set(keys) - {one})
    assert {r["reason"] for r in rows} == {"edit model needs exactly one control image"}
    assert sorted(r["detail"].split(";")[0] for r in rows) == ["sample has 0", "sample has 2"]
