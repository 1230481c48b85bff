"""Small helpers for store tests: a schema, deterministic samples, a filled store."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from schemas import FieldSpec, Lineage, TableSchema
from store import Store
from store.join import JoinedTables, KeyList
from store.manifest_view import ManifestView


def lineage(tag: str = "a") -> Lineage:
    return Lineage(stage="encode-vae", config_hash=f"cfg-{tag}", model_fingerprint="m", upstream={"images": 1},
                   code_version="0.1.0+f1")


def vae_schema(tag: str = "a") -> TableSchema:
    return TableSchema(
        name="vae",
        fields=[
            FieldSpec("target", "bfloat16", 4),
            FieldSpec("control_{i}", "bfloat16", 4),
            FieldSpec("mask_weight", "float32", 1, optional=True),
            FieldSpec("target.png", "png", kind="file", optional=True),
            FieldSpec("split", "string", kind="column"),
        ],
        lineage=lineage(tag),
    )


def key_of(i: int) -> str:
    return hashlib.sha256(f"sample-{i}".encode()).hexdigest()[:32]


def sample(i: int) -> dict:
    """Sample i: 0..2 controls, odd sizes, bf16 values that are not round numbers (exactness shows)."""
    g = torch.Generator().manual_seed(i)
    h, w = 4 + i % 3 * 2, 6 + i % 4 * 2
    tensors = {"target": torch.randn(4, 1, h, w, generator=g).bfloat16()}
    for c in range(i % 3):
        tensors[f"control_{c}"] = torch.randn(4, 1, h + 2, w, generator=g).bfloat16()
    if i % 2:
        tensors["mask_weight"] = torch.rand(h * w // 4, generator=g)
    files = {"target.png": bytes(range(i % 250)) * 3}
    shapes = [[1, h // 2, w // 2]] + [[1, (h + 2) // 2, w // 2]] * (i % 3)
    meta = {"split": "val" if i % 5 == 0 else "train", "img_shapes": shapes, "caption": f"caption {i}"}
    return {"key": key_of(i), "tensors": tensors, "files": files, "meta": meta}


def fill(store: Store, n: int, shard_size_mb: float = 0.004, tag: str = "a", start: int = 0) -> int:
    w = store.writer("vae", vae_schema(tag), shard_size_mb=shard_size_mb)
    for i in range(start, start + n):
        s = sample(i)
        w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    return w.commit()


def fill_images(store: Store, tag: str) -> int:
    """An `images` version of one sample under config hash `tag` (what a vae version names as upstream)."""
    schema = TableSchema(name="images", lineage=Lineage("resize-bucket", config_hash=tag, upstream={}),
                         fields=[FieldSpec("target.png", "png", kind="file"),
                                 FieldSpec("split", "string", kind="column"),
                                 FieldSpec("img_shapes", "json", kind="column")])
    w = store.writer("images", schema)
    w.add("0123456789abcdef0123456789abcdef", files={"target.png": tag.encode()},
          meta={"split": "train", "img_shapes": [[1, 2, 2]]})
    return w.commit()


def joined_over_manifests(data: dict[str, bytes], split: str = "train") -> JoinedTables:
    """A join of `split` over views of the given manifest bytes by table (text first; the same sorted keys), with
    no store behind it: what `JoinedTables.content_ids` reads, for tests/store/test_prefix_content_ids.py and
    bench/content_ids.py."""
    readers = {}
    for t, raw in data.items():
        schema = TableSchema(name=t, lineage=Lineage(f"encode-{t}", "synthetic", {}, "synthetic"), fields=[],
                             attrs={"feature_lineage": "synthetic"})
        buf = pa.py_buffer(raw)
        view = ManifestView(Path("/nonexistent") / t / "v1", t, 1, schema,
                            pq.ParquetFile(pa.BufferReader(buf)).schema_arrow.names, None, manifest_bytes=buf)
        readers[t] = SimpleNamespace(view=view, schema=schema, table=t, version=1)
    j = JoinedTables.__new__(JoinedTables)
    j.readers, j.split, j._contents, j._prefix_contents = readers, split, False, {}
    first = next(iter(readers.values())).view
    rows = np.flatnonzero(np.asarray(first.column("split").to_numpy(zero_copy_only=False)) == split)
    j.rows = {t: rows.astype(np.int32) for t in readers}
    j.keys = KeyList(first.keys.array, j.rows["text"])
    j.lengths = np.random.default_rng(0).integers(100, 5000, len(rows))
    return j


def read_only_open(real_open):
    """An `os.open` that refuses writes as a read-only file system does (EROFS); reads pass through."""
    import errno
    import os

    def opener(path, flags, *a):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a)

    return opener


def rank_writer(cache, url: str, rank: int, n: int, shard_size_mb: float, tag: str = "a", version: int = 1):
    """Rank `rank` of 2 writing its half of `n` samples into `version` of table `vae` of store URL `url` through
    the node cache `cache` (keys already committed there skipped: a rerun resumes)."""
    w = Store(cache).writer("vae", vae_schema(tag), rank=rank, world_size=2, shard_size_mb=shard_size_mb,
                            version=version, remote_url=url)
    w.given = len(range(rank, n, 2))  # as the encoders tell it: the commit checks the sum of the ranks' keys
    for i in range(rank, n, 2):
        s = sample(i)
        if s["key"] not in w.done_keys:
            w.add(s["key"], tensors=s["tensors"], files=s["files"], meta=s["meta"])
    return w


def push_every_version(store: Store, url: str):
    """`push` of every version of the store, a URL with history: push sends what the store's own gc keeps
    (store/gc.py `keep_rule`), so each version is held under a read lease meanwhile (one a newer current version
    replaced is sent as a version a reader still reads)."""
    from store import lease
    from store.remote_push import push

    held = [lease.hold(store.root, {table: v}, "push_every_version") for table in store.tables()
            for v in store.versions(table)]
    try:
        return push(store.root, url)
    finally:
        for one in held:
            one.release()
