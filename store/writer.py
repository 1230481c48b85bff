"""Resumable, multi-rank table writer: shards committed one by one (temp + fsync + rename), manifest last.

Version folder life cycle: `schema.json` written when the folder is created; each committed shard gets its
index sidecar (presence = committed); each rank that finished leaves `rank-XX.done`; rank 0's `commit()` merges
the indexes into `manifest.parquet` (presence = version complete) and then points `store.json` at it.

`TableWriter` holds the session's state and the public API; each phase lives in its own module:
store/writer_open.py (lock, the version to resume or create), store/writer_shards.py (checking samples,
filling and committing shards, carrying shards forward), store/writer_commit.py (rank done files, the commit).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import pyarrow as pa

from schemas.errors import UserError
from schemas.table import TableSchema
from store import format as fmt
from store.io_errors import writing
from store.writer_commit import commit_local, mark_rank_done
from store.writer_open import candidate_version, clean_temp_files, committed_in_share, committed_keys, index_paths, \
    lock_rank, next_shard_index, open_version, record_world
from store.writer_shards import RankShards, validate_sample

if TYPE_CHECKING:
    import torch

    from store.store import Store

# candidate_version, open_version: stages/encode/nodes.py imports them from here
__all__ = ["TableWriter", "candidate_version", "open_version"]

MB = 1024 * 1024


class TableWriter:
    def __init__(
        self, store: Store, table: str, schema: TableSchema,
        rank: int = 0, world_size: int = 1, shard_size_mb: float = 256,
        version: int | None = None, remote_url: str | None = None,
        share: Sequence[str] | None = None, agree: Callable[[bool], bool] = lambda alone: alone,
    ) -> None:
        """`share`: the keys this rank will add, disjoint from every other rank's (encode's slice of `images`):
        `done_keys` then holds only those of them in committed shards, and each rank reads its own shards' indexes
        alone when the previous run had the same shares (store/writer_open.py `committed_in_share`). With several
        ranks every rank then opens its writer together: `agree` makes this rank's verdict every rank's (True only
        if True on all); the default is one process's."""
        if schema.name != table:
            raise UserError(f"schema is for table {schema.name!r}, not {table!r}")
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is outside world_size {world_size}")
        self.store, self.table, self.schema = store, table, schema
        self.rank, self.world_size = rank, world_size
        # `store` is a node's cached copy of this URL and the ranks write through several caches: each rank
        # uploads its own part, rank 0 commits on the remote (store/remote_parts.py)
        self.remote_url = remote_url
        # how many keys the caller gave this rank (set once it knows them): its rank-done file records it with the
        # samples it rejected, and the commit refuses a table whose rows plus rejections fall short of the sum
        self.given: int | None = None
        # after a commit on a store URL: the higher version another writer made current there meanwhile, which
        # stays current (the remote is never rolled back, store/remote_parts.make_current); None: ours is current
        self.newer_current: int | None = None
        self.shard_bytes = max(1, int(shard_size_mb * MB))
        self._lock = lock_rank(store.root, table, rank)
        self._lease = None
        try:
            with writing(f"table '{table}'", store.root / table):
                self.version, self.dir = open_version(store.root, table, schema.to_dict(), version)
                record_world(self.dir, world_size, several_caches=remote_url is not None)
                clean_temp_files(self.dir, rank)
            if remote_url is not None:
                from store.remote_parts import adopt_uploaded, hold_parts

                # a push lease on the version before anything of it on the remote is relied on, held to the commit
                self._lease = hold_parts(self)
                adopt_uploaded(self)  # a node that lost its cache: its part already uploaded counts as committed
            if remote_url is not None:
                # several caches: a rank counts as done only what it uploads itself (its own shards: parts of
                # another world size were refused above, so they are its share's), as rank 0 merges only those
                self.done_keys: set[str] = committed_keys(index_paths(self.dir, rank))
            else:
                indexes = index_paths(self.dir)  # the committed shards of a resumed version
                self.done_keys = committed_keys(indexes) if share is None else committed_in_share(
                    indexes, rank, world_size, pa.array(list(share), pa.string()), agree)
            self._shards = RankShards(self.dir, rank, next_shard_index(self.dir, rank),
                                      self.shard_bytes, f"table '{table}' v{self.version}")
        except BaseException:  # the lock goes with a writer that failed to open (a long-lived process retries)
            if self._lease is not None:
                self._lease.release()
            self._lock.release()
            raise
        self._finished = False
        self._closed = False

    # ------------------------------------------------------------ adding samples

    def add(
        self, key: str, tensors: dict[str, torch.Tensor] | None = None,
        files: dict[str, bytes] | None = None, meta: dict[str, Any] | None = None,
    ) -> None:
        self._check_open()
        tensors, files, meta = dict(tensors or {}), dict(files or {}), dict(meta or {})
        if not fmt.KEY_RE.fullmatch(key):
            raise UserError(f"sample key {key!r} must be letters, digits, '_' or '-' (no dots: webdataset splits there)")
        if key in self.done_keys or key in self._shards.added:
            raise UserError(f"duplicate key {key} in table '{self.table}' (skip keys in writer.done_keys on resume)")
        validate_sample(self.schema, key, tensors, files, meta)
        self._shards.add(key, tensors, files, meta)

    @property
    def carried_keys(self) -> set[str]:
        """Keys added in this session (written or carried forward)."""
        return self._shards.added

    def columns_of(self, names: tuple[str, ...]) -> dict[str, tuple]:
        """key -> its meta columns `names` (None where absent) for every row the commit would hold: the version's
        committed shards (an earlier session's, this session's written and carried ones) and the open shard."""
        import pyarrow.parquet as pq

        out: dict[str, tuple] = {}
        for p in index_paths(self.dir):
            with pq.ParquetFile(p) as f:
                t = f.read(columns=[c for c in ("key", *names) if c in f.schema_arrow.names], use_threads=False)
            values = [t.column(n).to_pylist() if n in t.column_names else [None] * t.num_rows for n in names]
            out.update(zip(t.column("key").to_pylist(), zip(*values) if names else [()] * t.num_rows))
        out.update((k, tuple(m.get(n) for n in names)) for k, m in self._shards.open_rows())
        return out

    @property
    def linked_shards(self) -> set[str]:
        """Shard names carried forward (hard-linked) in this session."""
        return self._shards.linked

    @property
    def written_bytes(self) -> int:
        """Bytes of the shards this session wrote and committed (an earlier session's, carried forward ones and
        unreferenced tars a killed session left are not this session's writing)."""
        return self._shards.written_bytes

    @property
    def session_indexes(self) -> set[str]:
        """Index names of the shards committed in this session (written or carried forward)."""
        return self._shards.indexes

    def add_linked_shard(self, src: Path, rows: "pa.Table") -> str:
        """Carry samples forward from a committed, intact shard of another version (reuse, and repair's intact
        shards): the shard file is hard-linked (bytes shared, `fmt.link_or_copy`) under this rank's next shard
        name, and `rows` (its manifest rows for the samples carried, meta columns already updated) become that
        shard's index - the commit, as for a written shard.
        Returns the new shard name. Keys already added or committed are an error, as in `add`."""
        self._check_open()
        dup = [k for k in rows.column("key").to_pylist() if k in self.done_keys or k in self._shards.added]
        if dup:
            raise UserError(f"duplicate key {dup[0]} in table '{self.table}' (carried forward twice)")
        return self._shards.link(src, rows)

    def _check_open(self) -> None:
        if self._finished:
            raise UserError(f"writer for table '{self.table}' rank {self.rank} already finished; open a new one")

    # ------------------------------------------------------------ finishing

    def keep_open_shard(self) -> None:
        """Commit the open shard without finishing the rank: a stage that stops keeps the samples it added (the
        rerun resumes past them, as past any committed shard); the rank is still not done."""
        self._check_open()
        self._shards.commit()
        self._shards.sync()

    def finish_rank(self, rejected: int = 0) -> None:
        """Commit the open shard and mark this rank done (multi-rank: every rank calls this, then a barrier).
        `rejected`: how many of the `given` keys the caller left out (quarantined)."""
        if self._finished:
            return
        self._shards.commit()
        self._shards.sync()  # the linked shards' names durable before the done file says they are all committed
        mark_rank_done(self, rejected)
        self._finished = True

    def commit(self, allow_empty: bool = True) -> int:
        """Rank 0 (after every rank's `finish_rank`): write the manifest, then switch store.json. Returns the version.

        `allow_empty=False`: a version with no rows is refused (UserError) and nothing becomes current, so a stage
        whose every input was rejected fails instead of leaving an empty table that later reads as up to date.
        """
        if self.rank != 0:
            raise UserError(f"only rank 0 commits table '{self.table}'; rank {self.rank} calls finish_rank()")
        try:
            self.finish_rank()
            if self.remote_url is not None:
                from store.remote_parts import commit_remote

                return commit_remote(self, allow_empty)
            return commit_local(self, allow_empty)
        except BaseException:  # e.g. a full disk: give the lock back; a rerun resumes from the committed shards
            self.close()
            raise

    def close(self) -> None:
        """Release the lock without committing (a rerun resumes from the committed shards)."""
        if self._closed:
            return
        self._closed = True
        self._shards.drop()
        if self._lease is not None:
            self._lease.release()
        self._lock.release()

    def __enter__(self) -> "TableWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
