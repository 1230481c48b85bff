"""Adding samples to a table writer's version (store/writer.py): a sample checked against the schema, then
buffered into this rank's open shard, which is committed (tar, then its index) once it is big enough; and
committed shards of another version carried forward by hard link."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pyarrow as pa

from schemas import atomic_write
from schemas.errors import UserError
from schemas.img_shapes import normalize_img_shapes
from schemas.table import SCHEMA_V2, TableSchema
from store import format as fmt
from store.io_errors import writing
from store.manifest import RESERVED_COLUMNS, rows_to_table
from store.remote_shards import ensure_local
from store.shard import ShardBuilder, tensor_dtype_name

if TYPE_CHECKING:
    import torch


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
    forward) and the next shard index of the rank. `label` names the version in errors ("table 'vae' v3").

    A shard is named only when it is committed, by the first free name from `next_index` on: a name taken - by a
    shard this node's view of a shared folder does not list yet, whose index it may not list either - is never
    replaced (`atomic_write.rename_new`), so no committed shard is lost to a lagging view."""

    def __init__(self, vdir: Path, rank: int, next_index: int, shard_bytes: int, label: str) -> None:
        self.dir, self.rank, self.next_index = vdir, rank, next_index
        self.shard_bytes, self.label = shard_bytes, label
        self.added: set[str] = set()
        self.linked: set[str] = set()  # shard names carried forward (hard-linked) in this session
        self.written_bytes = 0  # bytes of the shards this session wrote and committed itself (not linked ones)
        self.indexes: set[str] = set()  # index names of the shards committed in this session (written or linked)
        self._done_dropped = False
        self._unsynced = False  # names of linked shards (and their indexes) not yet made durable by a folder fsync
        self._builder: ShardBuilder | None = None
        self._metas: list[dict[str, Any]] = []

    def _temp(self) -> Path:
        """A temp name of this rank (`<shard>.tar.tmp`: litter, which only this rank's writer makes and removes)."""
        return self.dir / (fmt.shard_name(self.rank, self.next_index) + ".tmp")

    def add(self, key: str, tensors: dict[str, torch.Tensor], files: dict[str, bytes], meta: dict[str, Any]) -> None:
        """Buffer a checked sample into the open shard; commit that shard once it reaches `shard_bytes`."""
        if self._builder is None:
            self._builder = ShardBuilder(self._temp())
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

    def open_rows(self) -> list[tuple[str, dict[str, Any]]]:
        """(key, meta) of each sample of the open shard (added, not committed yet)."""
        return [(r.key, m) for r, m in zip(self._builder.records, self._metas)] if self._builder is not None else []

    def drop_done(self) -> None:
        """Before this session's first new shard lands: the rank's `rank-RR.done` of an earlier session no longer
        says every shard of the rank is committed (a commit must not count the rank finished). `finish_rank`
        writes it again."""
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
        """Commit the open shard, if any: the tar named, then its index (presence = committed)."""
        b = self._builder
        if b is None:
            return
        if not b.records:
            self.drop()
            return
        self.drop_done()
        try:
            with writing(f"a shard of {self.label}", self.dir):
                sha = b.seal()
                nbytes = b.tmp_path.stat().st_size
                self._publish(b.tmp_path, lambda name: rows_to_table(b.records, self._metas, name, sha, nbytes,
                                                                     b.crc32c))
                self.written_bytes += nbytes
        except BaseException:  # full disk etc.: no uncommitted shard left behind; a rerun writes it again
            self.drop()
            raise
        self._builder = None
        self._metas = []
        fmt.crash_point("after_shard_commit")

    def sync(self) -> None:
        """Make the names of the shards linked in this session durable (one fsync of the folder): before the rank's
        done file, which says every shard of the rank is committed. A power loss before it may lose some linked
        shards' names (tar or index): those samples are not committed, and a resumed writer carries them again."""
        if self._unsynced:
            with writing(f"a shard of {self.label}", self.dir):
                atomic_write.fsync_dir(self.dir)
            self._unsynced = False

    def _publish(self, tmp: Path, index_of: Callable[[str], pa.Table], sync_dir: bool = True) -> str:
        """Name the finished shard file `tmp` with the first free shard name of the rank from `next_index` on, then
        write its index (`index_of(name)`): the commit. Returns the name; `next_index` is past it. `sync_dir=False`:
        the folder is not fsynced after the index (`sync` does it later)."""
        while True:
            name = fmt.shard_name(self.rank, self.next_index)
            self.next_index += 1
            try:
                atomic_write.rename_new(tmp, self.dir / name)
            except FileExistsError:  # a shard this view does not list (or whose index it does not): kept, skipped
                continue
            fmt.crash_point("shard_before_index")
            try:
                fmt.atomic_write_parquet(self.dir / fmt.index_name(name), index_of(name), replace=False,
                                         sync_dir=sync_dir)
                self.indexes.add(fmt.index_name(name))
                return name
            except FileExistsError:  # another shard's index, its tar not here (adopted from a store URL): skipped
                os.rename(self.dir / name, tmp)  # the tar named a moment ago is this one
            except BaseException:
                if not (self.dir / fmt.index_name(name)).exists():  # not committed (its index may be in place,
                    (self.dir / name).unlink(missing_ok=True)  # the folder's fsync failing after it: then kept)
                raise

    def link(self, src: Path, rows: pa.Table) -> str:
        """Hard-link the committed shard `src` under the rank's next free shard name, with `rows` (keys already
        checked) as its index: the commit, as for a written shard. Returns the new shard name."""
        keys = rows.column("key").to_pylist()
        self.commit()  # the open shard is named first
        self.drop_done()
        col = rows.schema.get_field_index("shard")
        field = rows.schema.field(col)

        def index_of(name: str) -> pa.Table:
            return rows.set_column(col, field, pa.array([name] * rows.num_rows, field.type))

        tmp = self._temp()
        with writing(f"a shard of {self.label}", self.dir):  # e.g. a full disk, named
            tmp.unlink(missing_ok=True)
            try:
                fmt.link_or_copy(ensure_local(Path(src)), tmp)  # a lazily cached source shard: fetched first
                # carried samples now committed; the folder fsynced once for all of them (`sync`), not per shard:
                # a hard link has no bytes of its own to make durable, only its name (a copy, where links fail, is
                # fsynced by `link_or_copy`), and the index's bytes are fsynced before its name exists
                name = self._publish(tmp, index_of, sync_dir=False)
                self._unsynced = True
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        self.linked.add(name)
        self.added.update(keys)
        fmt.crash_point("after_linked_shard")
        return name
