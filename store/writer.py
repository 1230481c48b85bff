"""Resumable, multi-rank table writer: shards committed one by one (temp + fsync + rename), manifest last.

Version folder life cycle: `schema.json` written when the folder is created; each committed shard gets its
index sidecar (presence = committed); each rank that finished leaves `rank-XX.done`; rank 0's `commit()` merges
the indexes into `manifest.parquet` (presence = version complete) and then points `store.json` at it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from schemas.errors import UserError
from schemas.img_shapes import normalize_img_shapes
from schemas.table import SCHEMA_V2, TableSchema
from store import format as fmt
from store.integrity import write_version_checksums
from store.io_errors import writing
from store.manifest import RESERVED_COLUMNS, merge_indexes, rows_to_table
from store.remote_shards import ensure_local
from store.shard import ShardBuilder, tensor_dtype_name

if TYPE_CHECKING:
    from store.store import Store

MB = 1024 * 1024


def candidate_version(root: Path, table: str, want: dict[str, Any]) -> int:
    """The version a writer with schema `want` opens: the newest in-progress one with that exact schema (resume),
    else one past the newest (call under the store lock; reads only)."""
    versions = fmt.list_versions(root, table)
    for v in reversed(versions):
        vdir = fmt.version_dir(root, table, v)
        if fmt.is_complete(vdir) or not (vdir / fmt.SCHEMA_JSON).is_file():
            continue
        if fmt.read_json(vdir / fmt.SCHEMA_JSON, "schema.json") == want:
            return v
    return (versions[-1] if versions else 0) + 1


class TableWriter:
    def __init__(
        self, store: Store, table: str, schema: TableSchema,
        rank: int = 0, world_size: int = 1, shard_size_mb: float = 256,
        version: int | None = None, remote_url: str | None = None,
    ) -> None:
        if schema.name != table:
            raise UserError(f"schema is for table {schema.name!r}, not {table!r}")
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside world_size {world_size}")
        self.store, self.table, self.schema = store, table, schema
        self.rank, self.world_size = rank, world_size
        # `store` is a node's cached copy of this URL and the ranks write through several caches: each rank
        # uploads its own part, rank 0 commits on the remote (store/remote_parts.py)
        self.remote_url = remote_url
        self.shard_bytes = max(1, int(shard_size_mb * MB))
        with writing(f"table '{table}'", store.root / table):
            (store.root / table).mkdir(parents=True, exist_ok=True)
            # One writer per (table, rank): a second one fails here at once instead of interleaving shards.
            self._lock = fmt.HeldLock(store.root / table / f".write-r{rank:02d}.lock",
                                      holder=f"table '{table}' (rank {rank})")
        try:
            with writing(f"table '{table}'", store.root / table):
                self.version, self.dir = self._open_version(version)
                self._clean_uncommitted()
            if remote_url is not None:  # a node that lost its cache: its part already uploaded counts as committed
                from store.remote_parts import adopt_uploaded

                adopt_uploaded(self)
        except BaseException:
            self._lock.release()
            raise
        self.done_keys: set[str] = self._committed_keys()
        self._added: set[str] = set()
        self.linked_shards: set[str] = set()  # shard names carried forward (hard-linked) in this session
        self._next_index = self._next_shard_index()
        self._builder: ShardBuilder | None = None
        self._metas: list[dict[str, Any]] = []
        self._finished = False
        self._closed = False

    # ------------------------------------------------------------ opening / resuming

    def _open_version(self, version: int | None = None) -> tuple[int, Path]:
        """Resume the in-progress version with this exact schema + lineage, else create v<N+1>; `version`: that
        one (agreed on by ranks that do not share this folder: stages/encode/nodes.py), resumed or created.

        Done under the store lock so that ranks starting together agree on one folder.
        """
        want = self.schema.to_dict()
        with fmt.flock(self.store.root / fmt.STORE_LOCK):
            v = candidate_version(self.store.root, self.table, want) if version is None else version
            vdir = fmt.version_dir(self.store.root, self.table, v)
            if vdir.is_dir():
                if not fmt.is_complete(vdir) and (vdir / fmt.SCHEMA_JSON).is_file() and \
                        fmt.read_json(vdir / fmt.SCHEMA_JSON, "schema.json") == want:
                    return v, vdir
                raise UserError(f"{vdir} is another writer's version (complete, or another schema), but the ranks "
                                f"agreed to write table '{self.table}' v{v}; remove that folder and rerun")
            vdir.mkdir(parents=True)
            try:
                fmt.atomic_write_json(vdir / fmt.SCHEMA_JSON, want)
            except BaseException:  # e.g. a full disk: no empty version folder left behind
                shutil.rmtree(vdir, ignore_errors=True)
                raise
            return v, vdir

    def _clean_uncommitted(self) -> None:
        """Drop this rank's half-written shards: temp files and tars whose index never got written."""
        prefix = f"shard-r{self.rank:02d}-"
        for p in self.dir.glob(prefix + "*.tar.tmp"):
            p.unlink()
        for p in self.dir.glob(f".{prefix}*.tmp-*"):  # an index write killed mid-way
            p.unlink(missing_ok=True)
        for p in self.dir.glob(prefix + "*.tar"):
            if not (self.dir / fmt.index_name(p.name)).is_file():
                p.unlink()
        (self.dir / fmt.rank_done_name(self.rank)).unlink(missing_ok=True)

    def _index_paths(self) -> list[Path]:
        return sorted(self.dir.glob("shard-r*-*.index.parquet"))

    def _committed_keys(self) -> set[str]:
        keys: set[str] = set()
        for p in self._index_paths():
            keys.update(pq.read_table(p, columns=["key"]).column("key").to_pylist())
        return keys

    def _next_shard_index(self) -> int:
        names = [p.name for p in self.dir.glob(f"shard-r{self.rank:02d}-*.tar")]
        if self.remote_url is not None:  # adopted indexes of shards that are only on the remote
            names += [p.name.replace(".index.parquet", ".tar")
                      for p in self.dir.glob(f"shard-r{self.rank:02d}-*.index.parquet")]
        idx = [int(m.group(2)) for name in names if (m := fmt.SHARD_RE.fullmatch(name))]
        return max(idx) + 1 if idx else 0

    # ------------------------------------------------------------ adding samples

    def add(
        self, key: str, tensors: dict[str, torch.Tensor] | None = None,
        files: dict[str, bytes] | None = None, meta: dict[str, Any] | None = None,
    ) -> None:
        if self._finished:
            raise UserError(f"writer for table '{self.table}' rank {self.rank} already finished; open a new one")
        tensors, files, meta = dict(tensors or {}), dict(files or {}), dict(meta or {})
        if not fmt.KEY_RE.fullmatch(key):
            raise UserError(f"sample key {key!r} must be letters, digits, '_' or '-' (no dots: webdataset splits there)")
        if key in self.done_keys or key in self._added:
            raise UserError(f"duplicate key {key} in table '{self.table}' (skip keys in writer.done_keys on resume)")
        self._validate(key, tensors, files, meta)
        if self._builder is None:
            self._builder = ShardBuilder(self.dir / fmt.shard_name(self.rank, self._next_index))
        try:
            with writing(f"a shard of table '{self.table}' v{self.version}", self.dir):
                self._builder.add(key, tensors, files, meta)
        except BaseException:  # e.g. a full disk: drop the open shard (temp file removed); a rerun redoes it
            self._drop_builder()
            raise
        self._metas.append(meta)
        self._added.add(key)
        if self._builder.nbytes >= self.shard_bytes:
            self._commit_shard()

    def _validate(self, key: str, tensors: dict[str, torch.Tensor], files: dict[str, bytes], meta: dict[str, Any]) -> None:
        where = f"table '{self.table}', sample {key}"
        for name, t in tensors.items():
            spec = self.schema.spec_for("tensor", name)
            if spec is None:
                raise UserError(f"{where}: tensor {name!r} is not a field of the schema")
            if tensor_dtype_name(t) != spec.dtype or t.dim() != spec.rank:
                raise UserError(f"{where}: tensor {name!r} is {t.dtype} rank {t.dim()}, schema says {spec.dtype} rank {spec.rank}")
        for name in files:
            if self.schema.spec_for("file", name) is None:
                raise UserError(f"{where}: file {name!r} is not a field of the schema")
            if name == "json" or name == "safetensors" or "/" in name:
                raise UserError(f"{where}: file name {name!r} is reserved or invalid")
        for kind, have in (("tensor", tensors), ("file", files), ("column", meta)):
            missing = [n for n in self.schema.required(kind) if n not in have]  # type: ignore[arg-type]
            if missing:
                raise UserError(f"{where}: missing required {kind}(s) {missing}")
        clash = RESERVED_COLUMNS & meta.keys()
        if clash:
            raise UserError(f"{where}: meta columns {sorted(clash)} are reserved by the manifest")
        if self.schema.schema_version >= SCHEMA_V2:
            try:
                meta["img_shapes"] = [list(s) for s in normalize_img_shapes(meta.get("img_shapes"))]
            except ValueError as e:
                raise UserError(f"{where}: {e} (schema v2 requires img_shapes in meta)") from None

    def _drop_builder(self) -> None:
        if self._builder is not None:
            self._builder.abandon()
            self._added -= {r.key for r in self._builder.records}
            self._builder = None
        self._metas = []

    def _commit_shard(self) -> None:
        b = self._builder
        if b is None:
            return
        if not b.records:
            self._drop_builder()
            return
        try:
            with writing(f"shard {b.final_path.name} of table '{self.table}' v{self.version}", self.dir):
                sha = b.commit()
                nbytes = b.final_path.stat().st_size
                index = rows_to_table(b.records, self._metas, b.final_path.name, sha, nbytes, b.crc32c)
                fmt.atomic_write_parquet(self.dir / fmt.index_name(b.final_path.name), index)  # shard now committed
        except BaseException:  # full disk etc.: no uncommitted shard left behind; a rerun writes it again
            self._drop_builder()
            b.final_path.unlink(missing_ok=True)
            raise
        self._builder = None
        self._metas = []
        self._next_index += 1
        fmt.crash_point("after_shard_commit")

    @property
    def carried_keys(self) -> set[str]:
        """Keys added in this session (written or carried forward)."""
        return self._added

    def add_linked_shard(self, src: Path, rows: "pa.Table") -> str:
        """Carry samples forward from a committed, intact shard of another version (reuse, and repair's intact
        shards): the shard file is hard-linked (bytes shared, `fmt.link_or_copy`) under this rank's next shard
        name, and `rows` (its manifest rows for the samples carried, meta columns already updated) become that
        shard's index - the commit, as for a written shard.
        Returns the new shard name. Keys already added or committed are an error, as in `add`."""
        if self._finished:
            raise UserError(f"writer for table '{self.table}' rank {self.rank} already finished; open a new one")
        keys = rows.column("key").to_pylist()
        dup = [k for k in keys if k in self.done_keys or k in self._added]
        if dup:
            raise UserError(f"duplicate key {dup[0]} in table '{self.table}' (carried forward twice)")
        self._commit_shard()  # an open shard keeps its reserved name; the linked one takes the next
        name = fmt.shard_name(self.rank, self._next_index)
        dst = self.dir / name
        col = rows.schema.get_field_index("shard")
        rows = rows.set_column(col, rows.schema.field(col), pa.array([name] * rows.num_rows, rows.schema.field(col).type))
        with writing(f"shard {name} of table '{self.table}' v{self.version}", self.dir):  # e.g. a full disk, named
            dst.unlink(missing_ok=True)
            fmt.link_or_copy(ensure_local(Path(src)), dst)  # a lazily cached source shard: fetched first
            fmt.atomic_write_parquet(self.dir / fmt.index_name(name), rows)  # carried samples now committed
        self.linked_shards.add(name)
        self._added.update(keys)
        self._next_index += 1
        fmt.crash_point("after_linked_shard")
        return name

    # ------------------------------------------------------------ finishing

    def finish_rank(self) -> None:
        """Commit the open shard and mark this rank done (multi-rank: every rank calls this, then a barrier)."""
        if self._finished:
            return
        self._commit_shard()
        done: dict[str, Any] = {"rank": self.rank, "world_size": self.world_size}
        if self.remote_url is not None:  # what rank 0 will list in checksums.json without reading the files
            from store.remote_parts import rank_files

            done["files"] = rank_files(self.dir, self.rank)
        with writing(f"table '{self.table}' v{self.version}", self.dir):
            fmt.atomic_write_json(self.dir / fmt.rank_done_name(self.rank), done)
        if self.remote_url is not None:
            from store.remote_parts import upload_rank

            upload_rank(self, done["files"])
        self._finished = True

    def commit(self, allow_empty: bool = True) -> int:
        """Rank 0 (after every rank's `finish_rank`): write the manifest, then switch store.json. Returns the version.

        `allow_empty=False`: a version with no rows is refused (UserError) and nothing becomes current, so a stage
        whose every input was rejected fails instead of leaving an empty table that later reads as up to date.
        """
        if self.rank != 0:
            raise UserError(f"only rank 0 commits table '{self.table}'; rank {self.rank} calls finish_rank()")
        try:
            return self._commit(allow_empty)
        except BaseException:  # e.g. a full disk: give the lock back; a rerun resumes from the committed shards
            self.close()
            raise

    def _commit(self, allow_empty: bool) -> int:
        self.finish_rank()
        if self.remote_url is not None:
            from store.remote_parts import commit_remote

            return commit_remote(self, allow_empty)
        missing = [r for r in range(self.world_size) if not (self.dir / fmt.rank_done_name(r)).is_file()]
        if missing:
            raise UserError(f"table '{self.table}' v{self.version}: ranks {missing} have not finished; "
                            "call commit() on rank 0 after a barrier")
        manifest = merge_indexes(self._index_paths())
        if manifest.num_rows == 0 and not allow_empty:
            self.close()
            raise UserError(f"table '{self.table}' v{self.version} would be empty: every input was rejected "
                            f"(reasons in {self.store.root / 'quarantine.parquet'}); fix the inputs or the settings")
        for p in self.dir.iterdir():  # temp files of killed writes: never part of a committed version
            if fmt.is_litter(p.name):
                p.unlink(missing_ok=True)
        manifest_bytes = fmt.parquet_bytes(manifest)
        with writing(f"the manifest of table '{self.table}' v{self.version}", self.dir, need=2 * len(manifest_bytes)):
            # checksums.json before the manifest: a complete version (manifest present) always has its checksums.
            write_version_checksums(self.dir, manifest, manifest_bytes)
            fmt.atomic_write_bytes(self.dir / fmt.MANIFEST, manifest_bytes)  # version complete from here on
        fmt.crash_point("after_manifest")
        self.store.set_current(self.table, self.version)
        self.close()
        return self.version

    def close(self) -> None:
        """Release the lock without committing (a rerun resumes from the committed shards)."""
        if self._closed:
            return
        self._closed = True
        self._drop_builder()
        self._lock.release()

    def __enter__(self) -> "TableWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

