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


@pytest.mark.parametrize("stage,table", [(encode_text, "text"), (encode_vae, "vae")])
def test_every_sample_refused_for_its_control_count_fails_before_the_model_loads(stage, table, tiny_edit_model,
                                                                                tmp_path, images_fixture,
                                                                                monkeypatch):
    """An Edit model over an Edit-Plus dataset: the control-count rule refuses every sample from the manifest's
    num_controls column, so the run fails in `open_job` (every rank together) with one line naming the counts,
    before the model loads (it loaded first, minutes for a 20B/7B model, and only then failed "would be empty"),
    and no version is begun. The fixed run takes v1."""
    import models.loading

    write_images_table, FixtureSample = images_fixture.write, images_fixture.Sample
    store = tmp_path / "store"
    write_images_table(store, [FixtureSample("two", (64, 64), [(64, 64)] * 2, [(64, 64)] * 2),
                               FixtureSample("two more", (64, 64), [(64, 64)] * 2, [(64, 64)] * 2),
                               FixtureSample("none", (64, 64), [], [])])
    loads, real = [], models.loading.load_component
    monkeypatch.setattr(models.loading, "load_component", lambda *a, **k: loads.append(a[1]) or real(*a, **k))
    with pytest.raises(UserError, match="would be empty") as e:
        stage.run(PipelineConfig(), store, tiny_edit_model)
    line = str(e.value)
    assert "\n" not in line and "all 3 samples of table 'images' v1" in line, line
    assert "1 with 0 controls, 2 with 2 controls" in line and "exactly one control image" in line, line
    assert loads == []  # the model was never loaded
    assert table not in Store(store).tables()
    assert not (store / table).exists() or not list((store / table).iterdir())  # no version begun
    write_images_table(store, [FixtureSample("one", (64, 64), [(64, 64)], [(64, 64)])], tag="b")  # fixed inputs
    assert stage.run(PipelineConfig(), store, tiny_edit_model).version == 1
    assert loads  # loaded once there was a sample to encode


def test_every_sample_rejected_after_reading_is_an_error_and_no_empty_table(tiny_plus_model, tmp_path,
                                                                           images_fixture):
    """Every sample read and rejected (here: each caption holds a placeholder token): the commit refuses the empty
    version and removes it (its rank-done files with it), the reasons stay in quarantine.parquet."""
    write_images_table, FixtureSample = images_fixture.write, images_fixture.Sample
    store = tmp_path / "store"
    write_images_table(store, [FixtureSample("make it <|image_pad|> red", (64, 64), [(64, 64)], [(64, 64)]),
                               FixtureSample("<|video_pad|>", (64, 64), [], [])])
    with pytest.raises(UserError, match="would be empty"):
        encode_text.run(PipelineConfig(), store, tiny_plus_model)
    st = Store(store)
    assert "text" not in st.tables()
    assert len(st.quarantine()) == 2  # the reasons are kept
    # the version it began is gone (it left v1 with its rank-done files: the fixed run below committed v2, and v1
    # stayed an incomplete version until `store gc`)
    assert not list((store / "text").glob("v*")) and not list((store / "text").glob(".v*"))
    write_images_table(store, [FixtureSample("one", (64, 64), [(64, 64)], [(64, 64)])], tag="b")  # fixed inputs
    assert encode_text.run(PipelineConfig(), store, tiny_plus_model).version == 1


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
    # nor their whole meta row: a refused sample's quarantine row takes its `source` cell alone (every meta column,
    # ~480 us a sample at 1M rows, was minutes for a table the model refuses most of)
    real_meta, metas = TableReader.meta, []
    monkeypatch.setattr(TableReader, "meta", lambda self, key: metas.append((self.table, key)) or real_meta(self, key))
    summary = stage.run(PipelineConfig(), store, tiny_edit_model)
    assert summary.encoded == 1 and summary.quarantined == 2
    assert [k for t, k in read if t == "images"] == [one]  # the refused samples' bytes were not read
    assert {k for t, k in metas if t == "images"} <= {one}, metas
    rows = Store(store).quarantine().to_pylist()
    assert sorted(r["key"] for r in rows) == sorted(set(keys) - {one})
    assert {r["reason"] for r in rows} == {"edit model needs exactly one control image"}
    assert sorted(r["detail"].split(";")[0] for r in rows) == ["sample has 0", "sample has 2"]
    assert sorted(r["source"] for r in rows) == ["fixture/0", "fixture/2"]  # the images rows' sources


def test_an_edit_models_vae_table_carries_no_sample_its_rule_refuses(tiny_edit_model, tiny_plus_model, tmp_path,
                                                                    images_fixture):
    """Edit and Edit-Plus with the same VAE files share encode-vae's feature lineage, so an Edit model's run carries
    the latents an Edit-Plus run stored. The control-count rule holds for carried samples too: a 2-control sample is
    quarantined, as a fresh encode quarantines it and as encode-text does (the `vae` table held it, the `text` table
    not: the two tables of one model disagreed on which samples exist)."""
    write_images_table, FixtureSample = images_fixture.write, images_fixture.Sample
    store = tmp_path / "store"
    keys = write_images_table(store, [FixtureSample("two", (64, 64), [(64, 64)] * 2, [(64, 64)] * 2),
                                      FixtureSample("one", (64, 64), [(64, 64)], [(64, 64)])], mask_sha256=True)
    one = next(k for k, s in keys.items() if s.caption == "one")
    edit_model = tmp_path / "edit-with-plus-vae"  # an Edit model with the Edit-Plus model's VAE files
    shutil.copytree(tiny_edit_model, edit_model)
    shutil.rmtree(edit_model / "vae")
    shutil.copytree(f"{tiny_plus_model}/vae", edit_model / "vae")
    plus = encode_vae.run(PipelineConfig(), store, tiny_plus_model)
    assert plus.encoded == 2
    edit = encode_vae.run(PipelineConfig(), store, str(edit_model))
    assert edit.reused == 1 and edit.quarantined == 1, edit  # the 1-control latents carried, not the 2-control ones
    with Store(store).reader("vae") as vae:
        assert vae.keys() == [one]
    rows = [r for r in Store(store).quarantine().to_pylist() if r["table_version"] == f"vae/v{edit.version}"]
    assert [r["reason"] for r in rows] == ["edit model needs exactly one control image"]


@pytest.mark.parametrize("stage", [encode_text, encode_vae])
def test_a_read_only_store_is_one_line_before_the_model_loads_and_read_when_up_to_date(stage, tiny_plus_model,
                                                                                        tmp_path, images_fixture,
                                                                                        monkeypatch):
    """A store on a read-only mount (simulated: the tests run as root, whom file modes do not stop): the stage
    said so at the writer's first file, after the model had loaded (minutes for a VL model). Now before it loads;
    a table already up to date there is still found so (nothing to write)."""
    import errno
    import os

    import models.loading

    write_images_table, FixtureSample = images_fixture.write, images_fixture.Sample
    store = tmp_path / "store"
    write_images_table(store, [FixtureSample("a", (64, 64), [(64, 64)], [(64, 64)])], seed=0)
    real_open = os.open

    def read_only_open(path, flags, *a):  # EROFS for writes under the store, as a read-only mount gives
        if str(path).startswith(str(store)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a)

    loads, real = [], models.loading.load_component
    monkeypatch.setattr(models.loading, "load_component", lambda *a, **k: loads.append(a[1]) or real(*a, **k))
    monkeypatch.setattr(os, "open", read_only_open)
    with pytest.raises(UserError, match=f"cannot write table '{stage.TABLE}': {store}.* is not writable") as e:
        stage.run(PipelineConfig(), store, tiny_plus_model)
    assert "\n" not in str(e.value) and loads == []  # the model was never loaded
    monkeypatch.setattr(os, "open", real_open)
    assert not stage.run(PipelineConfig(), store, tiny_plus_model).up_to_date
    monkeypatch.setattr(os, "open", read_only_open)
    assert stage.run(PipelineConfig(), store, tiny_plus_model).up_to_date


@pytest.mark.parametrize("stage", [encode_text, encode_vae])
def test_a_second_encode_of_the_store_is_refused_before_the_model_loads(stage, tiny_plus_model, tmp_path,
                                                                        images_fixture, monkeypatch):
    """Another process writes the table (its writer's lock held): a second encode was refused at its own writer,
    after its model had loaded (minutes for a VL model). Now before the load, in the writer's words; once the
    other has let go the stage runs."""
    import models.loading
    from store import format as fmt

    write_images_table, FixtureSample = images_fixture.write, images_fixture.Sample
    store = tmp_path / "store"
    write_images_table(store, [FixtureSample("a", (64, 64), [(64, 64)], [(64, 64)])], seed=0)
    loads, real = [], models.loading.load_component
    monkeypatch.setattr(models.loading, "load_component", lambda *a, **k: loads.append(a[1]) or real(*a, **k))
    lock = store / stage.TABLE / ".write-r00.lock"
    lock.parent.mkdir()
    held = fmt.HeldLock(lock, holder="the first encode")  # as a running writer holds it (its pid written in)
    try:
        with pytest.raises(UserError) as e:
            stage.run(PipelineConfig(), store, tiny_plus_model)
    finally:
        held.release()
    assert str(e.value).startswith(f"table '{stage.TABLE}' (rank 0) is being written by pid "), e.value
    assert f"(lock {lock}); wait for it to finish, or stop it, then rerun" in str(e.value), e.value
    assert loads == []  # the model was never loaded
    assert not stage.run(PipelineConfig(), store, tiny_plus_model).up_to_date
