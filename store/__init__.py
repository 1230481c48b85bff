"""The feature store (format: docs/store-format.md). Exact API others build on:

    from store import Store
    from schemas import Lineage, FieldSpec, TableSchema, SCHEMA_V1, SCHEMA_V2, img_shapes_from_pixels

    st = Store(path, create=True)                      # opens STORE/, writes store.json when absent
    st.tables() -> dict[str, int]                      # table -> current version
    st.versions(table) -> list[int]
    st.find_version(table, lineage: Lineage, serving=()) -> int | None   # complete version with identical lineage
                                                       # (or one of `serving`: versions that hold more)
    st.set_current(table, version)                     # after reusing a found version (no-op when current)
    st.version_id(table, version) -> str               # "v<N>-<manifest sha256[:16]>": identity for lineage/resume
        # a stage: `v = st.find_version(t, lin); if v is not None: st.set_current(t, v); return` (up to date),
        # else open a writer (an incomplete version with the same schema+lineage is resumed, else v<N+1>)
    st.add_quarantine(rows: Iterable[dict]) -> int     # needs source, stage, reason; key/detail/any more optional
    st.add_quarantine_table(rows: pyarrow.Table) -> int  # the same rows as text columns (quarantine.text_column)
    st.quarantine() -> pyarrow.Table

    schema = TableSchema(name="vae", lineage=Lineage(stage, config_hash, model_fingerprint, upstream={"images": 1},
                         code_version=...), fields=[FieldSpec("target", "bfloat16", rank=4),
                         FieldSpec("control_{i}", "bfloat16", 4), FieldSpec("target.png", "png", kind="file"),
                         FieldSpec("caption", "string", kind="column", optional=True)], attrs={...})
        # tensors: dtype + rank checked on add; `{i}` = numbered; required (non-optional) fields must be present.
        # schema_version defaults to 2: meta must hold img_shapes [[1, h, w], ...] (target first).
    w = st.writer(table, schema, rank=0, world_size=1, shard_size_mb=256)   # UserError if another writer holds
        # the (table, rank) lock; same schema+lineage as an incomplete version -> resumes it
    w.version; w.done_keys: set[str]                   # keys in committed shards: skip them
    st.writer(..., share=keys, agree=fn)               # done_keys of that rank's share only (encode; writer_open.py)
    w.add(key, tensors={name: Tensor}, files={name: bytes}, meta={column: json-able})  # duplicate key -> UserError
    w.finish_rank()                                    # every rank; then barrier; then on rank 0:
    w.commit() -> int                                  # manifest (sorted by key), then store.json switch
    w.close()                                          # give up the lock without committing (resume later)

    r = st.reader(table, version=None)                 # TableReader
    r.schema (TableSchema); r.version; len(r); r.keys(); r.manifest (pyarrow.Table); key in r
    r.get(key) -> {"key", "meta": {...}, "tensors": {name: Tensor (zero-copy mmap view)}, "files": {name: bytes}}
    r.meta(key) -> dict; r.tensors(key); r.files(key)  # meta: every meta column kept parsed (walks over the table)
    r.meta_of(keys, columns) -> {key: {column: value}}  # a few rows' columns read, nothing kept
    r.files_of(keys, damaged=None) -> {key: {name: bytes}}  # a few rows' files (their `files` cells read only)
    r.img_shapes(key) -> list[tuple[int, int, int]]    # v1: derived from pixel columns + one-line hint
    r.iter_keys(split=None, rank=0, world_size=1, seed=None, epoch=0, buffer_size=1024) -> list[str]
    r.shard_paths() -> list[Path]                      # for webdataset.WebDataset(...)
    j = st.join("text", "vae", split=None); j.keys; j.get(key) -> {"text": sample, "vae": sample}; j.iter_keys(...)
"""

from store.join import JoinedTables
from store.reader import TableReader
from store.store import Store
from store.writer import TableWriter

__all__ = ["JoinedTables", "Store", "TableReader", "TableWriter"]
