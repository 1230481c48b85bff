"""Which stored rows an encode rerun carries forward, and with which split (`stages.encode.output.carried_rows`):
the rule row by row as it was written (each sample's `images` meta: a row is carried when every match column holds
a value on both sides and they are equal; its split is the images' now, "train" where they record none), kept here
as the reference, against the whole-column lookup that replaced it, on the cases that rule separates: equal,
other and missing masks on either side, an images table without the mask or split column, rows without the mask
column, relabelled splits."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa

from schemas import FieldSpec, Lineage, TableSchema
from stages.encode.output import carried_rows
from store import Store
from store.reuse import with_columns


def _images(st: Store, name: str, columns: dict[str, list]):
    schema = TableSchema(name=name, lineage=Lineage("resize-bucket", config_hash=name, upstream={}, code_version="x"),
                         fields=[FieldSpec("target.png", "png", kind="file"),
                                 FieldSpec("img_shapes", "json", kind="column"),
                                 *(FieldSpec(c, "string", kind="column", optional=True) for c in columns)])
    w = st.writer(name, schema, shard_size_mb=0.0005)
    for i, k in enumerate(KEYS):
        meta = {c: v[i] for c, v in columns.items() if v[i] is not None}
        w.add(k, files={"target.png": bytes([i]) * 100}, meta={**meta, "img_shapes": [[1, 2, 2]]})
    w.commit()
    return st.reader(name)


def _row_by_row(images, rows: pa.Table, match: tuple[str, ...]) -> pa.Table:
    """The rule as it was (stages/encode/output.py before bench/encode_carry.py)."""
    keep = []
    for i, k in enumerate(rows.column("key").to_pylist()):
        meta = images.meta(k)
        keep.append(all(c in rows.column_names and meta.get(c) is not None
                        and rows.column(c)[i].as_py() == meta.get(c) for c in match))
    rows = rows.filter(pa.array(keep, pa.bool_()))
    split = {k: images.meta(k).get("split", "train") for k in rows.column("key").to_pylist()}
    return with_columns(rows, {"split": split})


KEYS = sorted(f"{i * 7919:032x}" for i in range(8))
MASKS_NOW = ["m0", "m1", "", "", "m4", None, "m6", None]  # None: an older images table recorded none
SPLITS_NOW = ["train", "val", "val", "train", "train", "val", "train", "val"]


def test_carried_rows_are_the_row_by_row_rule(tmp_path):
    st = Store(tmp_path / "store")
    images = {
        "masks and splits": _images(st, "images", {"mask_sha256": MASKS_NOW, "split": SPLITS_NOW}),
        "no mask column": _images(st, "images_nomask", {"split": SPLITS_NOW}),
        "no split column": _images(st, "images_nosplit", {"mask_sha256": MASKS_NOW}),
    }
    stored = ["m0", "other", "", "x", None, None, "m6", "m7"]  # equal, other, both none, ..., both unknown
    order = [6, 1, 0, 7, 3, 2, 5, 4]  # a version's rows are not in the images' order
    rows = pa.table({"key": [KEYS[i] for i in order], "split": ["train"] * 8,
                     "mask_sha256": pa.array([stored[i] for i in order], pa.string()),
                     "length": list(range(8))})
    cases = {"with the mask column": rows, "without": rows.drop_columns(["mask_sha256"]),
             "as one chunk each": pa.concat_tables([rows.slice(0, 3), rows.slice(3)])}
    for name, reader in images.items():
        for match in (("mask_sha256",), ()):
            for case, table in cases.items():
                want = _row_by_row(reader, table, match)
                got = carried_rows(SimpleNamespace(images=reader, match_columns=match, prompt_fits=None), table)
                assert got.to_pylist() == want.to_pylist(), (name, match, case)
                assert got.schema == want.schema, (name, match, case)
    # what the rule keeps here: the equal masks (and "" = no mask on both sides), relabelled to the split now
    vae_job = SimpleNamespace(images=images["masks and splits"], match_columns=("mask_sha256",), prompt_fits=None)
    got = carried_rows(vae_job, rows)
    assert [(r["key"], r["split"]) for r in got.to_pylist()] == [(KEYS[6], "train"), (KEYS[0], "train"),
                                                                  (KEYS[2], "val")]
