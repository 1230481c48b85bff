"""What a reader keeps per rank (issue 24 point 10): one parsed key column for joined tables with the same keys,
joined keys as rows into it (no copy), columns only opening / joining needs dropped after, CRCs as numbers -
and every read still the same (keys, img_shapes, tensors, a damaged sample refused)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from damage import flip_bit, sample_byte
from store import Store
from store.integrity import DamagedData
from store.join import JoinedTables
from store.manifest_files import read_manifest
from store_samples import sample, vae_schema


def _tables(store: Store, ranges: dict[str, range]) -> None:
    for table, indices in ranges.items():
        w = store.writer(table, replace(vae_schema(), name=table), shard_size_mb=0.004)
        for i in indices:
            s = sample(i)
            w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
        w.commit()


def test_joined_tables_with_the_same_keys_keep_one_key_column_and_no_copy(store: Store) -> None:
    _tables(store, {"text": range(12), "vae": range(12)})
    left, right = store.reader("text"), store.reader("vae")
    expected = {sample(i)["key"]: sample(i) for i in range(12) if sample(i)["meta"]["split"] == "train"}
    joined = JoinedTables({"text": left, "vae": right}, "train")
    assert right.key_array is left.key_array  # parsed once
    assert joined.keys.source is left.key_array and joined.rows["text"] is joined.rows["vae"]
    for r in (left, right):
        assert not {"split", "shard_nbytes"} & r.view.parsed  # only opening and joining read them
    assert list(joined.keys) == sorted(expected) and joined.keys[1:3] == sorted(expected)[1:3]
    for i in range(len(joined)):
        key, a, b, shapes, _ = joined.features_at(i)
        want = expected[key]
        assert right.row_of(key) == left.row_of(key) == int(joined.rows["vae"][i])
        assert [list(s) for s in shapes] == want["meta"]["img_shapes"]
        for got in (a, b):
            assert got.keys() == want["tensors"].keys()
            for name, t in want["tensors"].items():
                assert torch.equal(got[name], t)
    joined.close()


def test_tables_with_other_rows_outside_the_split_keep_their_own_rows(store: Store) -> None:
    """The same train keys, but `left` holds val samples `right` lacks: each table's rows are its own."""
    _tables(store, {"left": range(12), "right": [i for i in range(12) if sample(i)["meta"]["split"] == "train"]})
    joined = JoinedTables({"left": store.reader("left"), "right": store.reader("right")}, "train")
    assert not (joined.rows["left"] == joined.rows["right"]).all()
    for t, r in joined.readers.items():
        assert [r.key_array[int(i)].as_py() for i in joined.rows[t]] == list(joined.keys)
    joined.close()


def test_a_reader_over_a_given_manifest_drops_what_only_opening_read(store: Store) -> None:
    """`store repair`'s reader over a rebuilt manifest table: its parsed columns are copies of the table's, so the
    open-time size check's `shard_nbytes` goes as it does from a reader of the version (a later read parses it
    again). Before: `forget` kept every column of a view over a given table."""
    from store.reader import TableReader

    _tables(store, {"vae": range(8)})
    v = store.tables()["vae"]
    vdir = store.version_dir("vae", v)
    manifest = read_manifest(vdir, (vdir / "manifest.parquet").read_bytes())
    r = TableReader.over_manifest(vdir, "vae", v, manifest)
    assert "shard_nbytes" not in r.view.parsed
    assert r.view.column("shard_nbytes").to_pylist() == manifest.column("shard_nbytes").to_pylist()
    r.close()


def test_crcs_kept_as_numbers_are_the_recorded_ones_and_still_refuse_damage(store: Store) -> None:
    _tables(store, {"vae": range(8)})
    r = store.reader("vae")
    recorded = read_manifest(r.dir, (r.dir / "manifest.parquet").read_bytes(), ["sample_crc32c"]).column(0)
    r.prepare_checks()
    crcs = r.view.samples.crcs()
    assert crcs is not None and "sample_crc32c" not in r.view.parsed
    assert [f"{int(c):08x}" for c in crcs] == recorded.to_pylist()
    r.close()
    key = sample(3)["key"]
    shard, pos = sample_byte(store.root, "vae", key)
    flip_bit(shard, pos, 0)
    r = Store(store.root, create=False).reader("vae")
    with pytest.raises(DamagedData, match="crc32c mismatch"):
        r.tensors(key)
    r.tensors(sample(4)["key"])  # the others read
    r.close()


def test_locating_columns_kept_narrow_read_the_recorded_values(store: Store) -> None:
    """Offsets and sizes as uint32, img_shapes as int16 (half and a quarter of int64 per rank): the same values."""
    import pyarrow as pa

    from store.arrow_columns import NARROWER, narrowed

    _tables(store, {"vae": range(8)})
    r = store.reader("vae")
    names = ["sample_offset", "sample_nbytes", "img_shapes"]
    recorded = read_manifest(r.dir, (r.dir / "manifest.parquet").read_bytes(), names)
    assert recorded.column("sample_offset").type == pa.int64()  # as written
    for name, kept in zip(names, (pa.uint32(), pa.uint32(), pa.list_(pa.list_(pa.int16())))):
        assert r.view.column(name).type == kept
        assert r.view.column(name).to_pylist() == recorded.column(name).to_pylist()
    r.close()
    # values that do not fit keep a wider type, never a wrapped value
    wide = pa.array([[[1, 40000, 2]]], pa.list_(pa.list_(pa.int64())))
    assert narrowed(wide, NARROWER["img_shapes"]).to_pylist() == [[[1, 40000, 2]]]
    assert narrowed(wide, NARROWER["img_shapes"]).type == pa.list_(pa.list_(pa.int32()))
    far = pa.array([5 << 32], pa.int64())
    assert narrowed(far, NARROWER["sample_offset"]).to_pylist() == [5 << 32]


def test_one_sample_s_meta_turns_no_column_into_python_objects(store: Store) -> None:
    """`meta(key)`, which the encoders ask for every sample on every rank, turned each meta column of the whole
    table into Python objects and kept them (~1.8 GB per rank at 1M samples). Now it reads the sample's cells."""
    _tables(store, {"vae": range(12)})
    with store.reader("vae") as r:
        for i in (0, 7):
            s = sample(i)
            got = r.meta(s["key"])
            assert all(got[k] == v for k, v in s["meta"].items()), (got, s["meta"])
        assert r.view.as_python == set()


def test_a_few_samples_meta_reads_their_rows_and_keeps_no_column(store: Store, monkeypatch) -> None:
    """`meta_of` (evaluate's captions of the samples it shows): the values `meta` reads, across batches of rows,
    with no column parsed and kept - `meta` parsed every meta column of the table and kept it (`images` at 1M
    samples: ~735 MB in evaluate, on every rank). Columns parsed already are read from their arrays."""
    from schemas.errors import UserError
    from store import manifest_view

    monkeypatch.setattr(manifest_view, "_ROWS_PER_BATCH", 3)  # 12 rows: four batches
    _tables(store, {"vae": range(12)})
    keys = [sample(i)["key"] for i in (11, 0, 4, 5, 0)]
    with store.reader("vae") as r:
        got = r.meta_of(keys, ["caption", "img_shapes", "not-a-column"])
        assert not set(r.meta_columns()) & r.view.parsed
        assert got == {k: {"caption": r.meta(k)["caption"], "img_shapes": r.meta(k)["img_shapes"]} for k in keys}
        assert got[sample(4)["key"]] == {"caption": "caption 4", "img_shapes": sample(4)["meta"]["img_shapes"]}
        assert r.meta_of([sample(3)["key"]], ["caption"]) == {sample(3)["key"]: {"caption": "caption 3"}}
        assert r.meta_of([], ["caption"]) == {}
        with pytest.raises(UserError, match="not in"):
            r.meta_of([sample(99)["key"]], ["caption"])


def test_a_rank_s_epoch_order_turns_no_column_into_python_objects(store: Store) -> None:
    """`iter_keys` (each encode rank's share of `images`) and the join's `iter_keys` turned every key and the
    `shard` / `split` columns into Python lists, kept by the reader (~160 MB per rank at 1M samples, ~220 MB for
    a join; bench/epoch_keys.py): the order is worked out on row numbers, only the rank's keys become str."""
    _tables(store, {"text": range(12), "vae": range(12)})
    with store.reader("vae") as r:
        parts = [r.iter_keys(split="train", rank=i, world_size=2, seed=None) for i in (0, 1)]
        assert sorted(parts[0] + parts[1]) == sorted(sample(i)["key"] for i in range(12) if i % 5)
        assert r.view.as_python == set()
    joined = JoinedTables({"text": store.reader("text"), "vae": store.reader("vae")}, "train")
    assert sorted(joined.iter_keys(rank=0, world_size=1, seed=3)) == sorted(joined.keys)
    assert all(t.view.as_python == set() for t in joined.readers.values())
    joined.close()


def test_a_view_and_its_parsed_columns_go_with_its_last_reference(store: Store) -> None:
    """The manifest view composes its key index and sample locator; a locator holding the view itself would make
    a cycle, and a dropped reader's parsed columns (hundreds of MB at 1M samples) would wait for the cyclic
    collector. Without it they go with the last reference, the collector off."""
    import gc
    import weakref

    from store.manifest_view import ManifestView

    _tables(store, {"vae": range(8)})
    gc.collect()
    gc.disable()
    try:
        v = store.tables()["vae"]
        view = ManifestView.open(store.version_dir("vae", v), "vae", v)
        key = sample(3)["key"]
        view.samples.prepare_checks()
        assert view.samples.locate(view.keys.index(key))[2] > 0 and view.samples.checksum_row(0)
        assert view.samples.crcs() is not None and view.samples.rows_in([view.samples.shard_of(0)]).size
        gone = weakref.ref(view)
        del view
        assert gone() is None
    finally:
        gc.enable()


def test_a_version_id_hashed_as_the_manifest_is_read_is_the_id_of_its_bytes(store: Store) -> None:
    """`Store.version_id` (evaluate names the tables with it, each run) read the whole manifest into memory to
    hash it (~140 MB per table at 1M samples); now it hashes the file as it reads: the same id, the same one a
    reader's view gives from its mapped bytes."""
    import hashlib

    from store import format as fmt

    _tables(store, {"vae": range(12)})
    data = (store.version_dir("vae", 1) / fmt.MANIFEST).read_bytes()
    assert store.version_id("vae", 1) == f"v1-{hashlib.sha256(data).hexdigest()[:16]}" == fmt.version_id(1, data)
    with store.reader("vae") as r:
        assert r.view.version_id() == store.version_id("vae", 1)
