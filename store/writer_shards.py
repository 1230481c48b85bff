"""Adding samples to a table writer's version (store/writer.py): a sample checked against the schema, then
buffered into this rank's open shard, which is committed (tar, then its index) once it is big enough; and
committed shards of another version carried forward by hard link."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from schemas.errors import UserError
from schemas.img_shapes import normalize_img_shapes
from schemas.table import SCHEMA_V2, TableSchema
from store import format as fmt
from store.io_errors import writing
from store.manifest import RESERVED_COLUMNS, rows_to_table
from store.remote_shards import ensure_local
from store.shard import ShardBuilder, tensor_dtype_name


def validate_sample(schema: TableSchema, key: str, tensors: dict[str, torch.Tensor], files: dict[str, bytes],
                    meta: dict[str, Any]) -> None:
    """UserError unless the sample fits `schema`; a v2 sample's `meta["img_shapes"]` is normalized in place."""
    where = f"table '{schema.name}', sample {key}"
    for name, t in tensors.items():
        spec = schema.spec_for("tensor", name)
        if spec is None:
            raise UserError(f"{where}: tensor {name!r} is not a field of the schema")
        if tensor_dtype_name(t) != spec.dtype or t.dim() != spec.rank:
            raise UserError(f"{where}: tensor {name!r} is {t.dtype} rank {t.dim()}, schema says {spec.dtype} rank {spec.rank}")
    for name in files:
        if schema.spec_for("file", name) is None:
            raise UserError(f"{where}: file {name!r} is not a field of the schema")
        if name == "json" or name == "safetensors" or "/" in name:
            raise UserError(f"{where}: file name {name!r} is reserved or invalid")
    for kind, have in (("tensor", tensors), ("file", files), ("column", meta)):
        missing = [n for n in schema.required(kind) if n not in have]  # type: ignore[arg-type]
        if missing:
            raise UserError(f"{where}: missing required {kind}(s) {missing}")
    clash = RESERVED_COLUMNS & meta.keys()
    if clash:
        raise UserError(f"{where}: meta columns {sorted(clash)} are reserved by the manifest")
    if schema.schema_version >= SCHEMA_V2:
        try:
            meta["img_shapes"] = [list(s) for s in normalize_img_shapes(meta.get("img_shapes"))]
        except ValueError as e:
            raise UserError(f"{where}: {e} (schema v2 requires img_shapes in meta)") from None


class RankShards:
    """One rank's shards of this writing session: the open shard, the keys added (written or carried
    forward) and the next shard index of the rank. `label` names the version in errors ("table 'vae' v3")."""

    def __init__(self, vdir: Path, rank: int, next_index: int, shard_bytes: int, label: str) -> None:
        self.dir, self.rank, self.next_index = vdir, rank, next_index
        self.shard_bytes, self.label = shard_bytes, label
        self.added: set[str] = set()
        self.linked: set[str] = set()  # shard names carried forward (hard-linked) in this session
        self._done_dropped = False
        self._builder: ShardBuilder | None = None
        self._metas: list[dict[str, Any]] = []

    def add(self, key: str, tensors: dict[str, torch.Tensor], files: dict[str, bytes], meta: dict[str, Any]) -> None:
        """Buffer a checked sample into the open shard (opened at the rank's next index); commit that shard once
        it reaches `shard_bytes`."""
        if self._builder is None:
            self._builder = ShardBuilder(self.dir / fmt.shard_name(self.rank, self.next_index))
        try:
            with writing(f"a shard of {self.label}", self.dir):
                self._builder.add(key, tensors, files, meta)
        except BaseException:  # e.g. a full disk: drop the open shard (temp file removed); a rerun redoes it
            self.drop()
            raise
        self._metas.append(meta)
        self.added.add(key)
        if self._builder.nbytes >= self.shard_bytes:
            self.commit()

    def drop_done(self) -> None:
        """Before this session's first new shard lands: the rank's `rank-RR.done` of an earlier session no longer
        says every shard of the rank is committed (`writer_open.clean_uncommitted` relies on it, and a commit must
        not count the rank finished). `finish_rank` writes it again."""
        if not self._done_dropped:
            with writing(f"{fmt.rank_done_name(self.rank)} of {self.label}", self.dir):
                (self.dir / fmt.rank_done_name(self.rank)).unlink(missing_ok=True)
            self._done_dropped = True

    def drop(self) -> None:
        """Abandon the open shard (its temp file removed, its keys no longer added)."""
        if self._builder is not None:
            self._builder.abandon()
            self.added -= {r.key for r in self._builder.records}
            self._builder = None
        self._metas = []

    def commit(self) -> None:
        """Commit the open shard, if any: the tar renamed into place, then its index (presence = committed)."""
        b = self._builder
        if b is None:
            return
        if not b.records:
            self.drop()
            return
        self.drop_done()
        try:
            with writing(f"shard {b.final_path.name} of {self.label}", self.dir):
                sha = b.commit()
                nbytes = b.final_path.stat().st_size
                index = rows_to_table(b.records, self._metas, b.final_path.name, sha, nbytes, b.crc32c)
                fmt.atomic_write_parquet(self.dir / fmt.index_name(b.final_path.name), index)  # shard now committed
        except BaseException:  # full disk etc.: no uncommitted shard left behind; a rerun writes it again
            self.drop()
            b.final_path.unlink(missing_ok=True)
            raise
        self._builder = None
        self._metas = []
        self.next_index += 1
        fmt.crash_point("after_shard_commit")

    def link(self, src: Path, rows: pa.Table) -> str:
        """Hard-link the committed shard `src` under the rank's next shard name, with `rows` (keys already checked)
        as its index: the commit, as for a written shard. Returns the new shard name."""
        keys = rows.column("key").to_pylist()
        self.commit()  # an open shard keeps its reserved name; the linked one takes the next
        self.drop_done()
        name = fmt.shard_name(self.rank, self.next_index)
        dst = self.dir / name
        col = rows.schema.get_field_index("shard")
        rows = rows.set_column(col, rows.schema.field(col), pa.array([name] * rows.num_rows, rows.schema.field(col).type))
        with writing(f"shard {name} of {self.label}", self.dir):  # e.g. a full disk, named
            dst.unlink(missing_ok=True)
            fmt.link_or_copy(ensure_local(Path(src)), dst)  # a lazily cached source shard: fetched first
            fmt.atomic_write_parquet(self.dir / fmt.index_name(name), rows)  # carried samples now committed
        self.linked.add(name)
        self.added.update(keys)
        self.next_index += 1
        fmt.crash_point("after_linked_shard")
        return name
