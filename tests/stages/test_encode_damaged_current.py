"""`stages/encode/current.py`: which samples a version left out as damaged inputs (on_damaged=skip), from the
store's quarantine rows for that very version and its manifest. The end-to-end reruns are in
test_damage_rerun.py."""

from __future__ import annotations

import torch

from schemas import FieldSpec, Lineage, TableSchema
from stages.encode.current import left_out, left_out_on_remote, serving_version
from stages.encode.summary import DAMAGED_INPUT
from store import Store


def _version(st: Store, keys: list[str]) -> int:
    schema = TableSchema(name="vae", fields=[FieldSpec("x", "float32", 1), FieldSpec("split", "string", kind="column")],
                         lineage=Lineage(stage="encode-vae", config_hash="c", model_fingerprint="m",
                                         upstream={"images": 1}, code_version="0.1.0+f1"))
    w = st.writer("vae", schema)
    for k in keys:
        w.add(k, tensors={"x": torch.zeros(2)}, meta={"split": "train", "img_shapes": [[1, 2, 2]]})
    return w.commit()


def _rejected(key: str, table_version: str, reason: str = DAMAGED_INPUT) -> dict:
    return {"key": key, "source": f"images/v1/{key}", "stage": "encode-vae", "reason": reason, "detail": "",
            "table_version": table_version}


def test_only_damaged_inputs_this_version_lacks_are_left_out(tmp_path):
    st = Store(tmp_path / "store")
    assert _version(st, ["a", "b"]) == 1
    assert left_out(st, "vae", 1) == []  # no quarantine file at all
    st.add_quarantine([
        _rejected("c", "vae/v1"),  # left out under skip
        _rejected("b", "vae/v1"),  # quarantined by a run that failed before its commit; the resume encoded it
        _rejected("d", "vae/v1", reason="image unreadable"),  # rejected under stop as well
        _rejected("e", "vae/v2"), _rejected("f", "text/v1"),  # other versions, other tables
    ])
    assert left_out(st, "vae", 1) == ["c"]
    assert serving_version(st, "encode-vae", "vae", 1, "stop") is None
    assert serving_version(st, "encode-vae", "vae", 1, "skip") == 1
    assert _version(st, ["a", "b", "c", "e"]) == 2 and serving_version(st, "encode-vae", "vae", 2, "stop") == 2


def test_a_remote_versions_left_out_samples_from_the_remotes_rows_and_the_nodes_cache(tmp_path):
    """A store URL's version the cache need not hold (stages/encode/nodes.writer_place): its keys from the remote's
    manifest, the rows from the remote's quarantine.parquet and from this node's cache (a lost store.json swap left
    a node's rows there alone)."""
    from store.remote_push import push

    st = Store(tmp_path / "store")
    assert _version(st, ["a", "b"]) == 1
    st.add_quarantine([_rejected("c", "vae/v1"), _rejected("b", "vae/v1")])
    url = f"file://{tmp_path / 'remote'}"
    push(st.root, url)
    cache = Store(tmp_path / "cache")  # holds no copy of v1
    cache.add_quarantine([_rejected("d", "vae/v1"), _rejected("e", "vae/v2")])
    assert left_out_on_remote(cache, url, "vae", 1, remote_rows=True) == ["c", "d"]
    assert left_out_on_remote(cache, url, "vae", 1, remote_rows=False) == ["d"]  # another node's rank: its own rows
    assert left_out_on_remote(Store(tmp_path / "empty"), url, "vae", 1, remote_rows=False) == []
