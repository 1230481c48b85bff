"""`store inspect`'s numbers (samples, shards, bytes, splits, target and control buckets), counted in Arrow over the
columns it reads, against the same numbers counted in Python from what was written."""

from __future__ import annotations

from collections import Counter

from schemas import FieldSpec, Lineage, TableSchema
from store import Store
from store.inspect import describe
from store_samples import fill, sample


def test_counts_of_a_table_with_img_shapes(tmp_path):
    st = Store(tmp_path / "s")
    fill(st, 23)  # several tiny shards
    v = describe(st.root)["tables"]["vae"]["versions"][0]
    metas = [sample(i)["meta"] for i in range(23)]
    assert v["samples"] == 23
    assert v["splits"] == dict(Counter(m["split"] for m in metas))
    shapes = Counter((m["img_shapes"][0][1] * 16, m["img_shapes"][0][2] * 16) for m in metas)
    assert v["buckets"] == {f"{h}x{w}": n for (h, w), n in sorted(shapes.items())}
    rows = st.reader("vae").view
    shard_bytes = dict(zip(rows.values("shard"), rows.values("shard_nbytes")))
    assert v["shards"] == len(shard_bytes) > 1 and v["bytes"] == sum(shard_bytes.values())


def test_counts_of_a_table_with_buckets_and_control_sizes(tmp_path):
    schema = TableSchema(name="images", fields=[
        FieldSpec("split", "string", kind="column"), FieldSpec("bucket", "json", kind="column"),
        FieldSpec("control_sizes", "json", kind="column")],
        lineage=Lineage(stage="resize-bucket", config_hash="c", model_fingerprint="", upstream={}, code_version="t"))
    st = Store(tmp_path / "s")
    w = st.writer("images", schema)
    buckets, controls = [[96, 128], [128, 96], [1024, 64], [96, 128]], [[], [[64, 64]], [[64, 64], [32, 2048]], []]
    for i, (b, c) in enumerate(zip(buckets, controls)):
        w.add(f"k{i}", meta={"split": "val" if i == 2 else "train", "bucket": b, "control_sizes": c,
                         "img_shapes": [[1, 4, 4]]})
    w.commit()
    v = describe(st.root)["tables"]["images"]["versions"][0]
    assert v["buckets"] == {"96x128": 2, "128x96": 1, "1024x64": 1}
    assert list(v["buckets"]) == ["96x128", "128x96", "1024x64"]  # sorted by (height, width)
    assert v["control_buckets"] == {"32x2048": 1, "64x64": 2}
    assert v["splits"] == {"train": 3, "val": 1}
