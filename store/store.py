"""`Store`: one folder of versioned tables plus `store.json` naming each table's current version."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import pyarrow as pa

from schemas.errors import UserError
from schemas.lineage import Lineage
from schemas import up_to_date
from schemas.table import TableSchema
from store import format as fmt
from store import quarantine
from store.join import JoinedTables
from store.integrity import DamagedData
from store.manifest_files import checked_schema
from store.reader import DEFAULT_MAX_OPEN_SHARDS, TableReader
from store.writer import TableWriter

log = logging.getLogger("store")

# (manifest path, its `_stat_identity`) -> `Store.version_id`: what reads a version's id again (a resize rerun
# reads a note of every complete version, each tied to its id; evaluate names its tables) hashes its manifest once
# per process, not once per read (~0.3 s at 1M rows). Keyed by the manifest file's identity, never the version
# number: a gc'd v2 and a later v2 are two files (the read leases' rule, store/lease.py); with its ctime, as the
# schema cache's checksums.json: an id decides which notes and "unchanged by fixes" records (reuse) and which
# upstream lineage a version stands for, and a rewrite in place of the same size with its mtime set back kept
# inode, mtime and size. Oldest out past the bound.
_VERSION_IDS: dict[tuple[str, tuple[int, ...]], str] = {}
_VERSION_IDS_KEPT = 4096
_VERSION_IDS_LOCK = threading.Lock()


class Store:
    def __init__(self, path: str | Path, create: bool = True) -> None:
        self.root = Path(path)
        if not (self.root / fmt.STORE_JSON).is_file():
            if not create:
                raise UserError(f"no store at {self.root} (no {fmt.STORE_JSON}); check the path or run a stage first")
            self.root.mkdir(parents=True, exist_ok=True)
            with fmt.flock(self.root / fmt.STORE_LOCK):
                if not (self.root / fmt.STORE_JSON).is_file():
                    fmt.write_store_record(self.root, fmt.new_store_record())
        fmt.read_store_record(self.root)  # format + version checked on every open
        # (table, version) -> (its schema.json's bytes and checksums.json's `_identity`, the checked schema): a
        # rerun asks `find_version` / `reusable_keys` about several lineages, each of which read every version's
        # schema again (8 reads for 2 versions). By the schema's own bytes (a few kB, read again at every ask; its
        # stat could hold over a rewrite in place - the same size, its mtime set back or within the clock's tick),
        # so a gc'd and rebuilt v2, or a schema.json damaged since, is read and checked again.
        self._schemas: dict[tuple[str, int], tuple[tuple, TableSchema]] = {}

    # ------------------------------------------------------------ tables and versions

    def tables(self) -> dict[str, int]:
        rec = fmt.read_store_record(self.root)
        return {t: int(v["current"]) for t, v in sorted(rec["tables"].items())}

    def versions(self, table: str) -> list[int]:
        return fmt.list_versions(self.root, table)

    def version_dir(self, table: str, version: int) -> Path:
        return fmt.version_dir(self.root, table, version)

    def version_id(self, table: str, version: int) -> str:
        """`v<N>-<sha256 of its manifest>`: names one immutable version for lineage and resume records.

        A version number alone is not enough: delete a table folder and rebuild it, and its versions restart at 1
        with other contents; a downstream table or a checkpoint must then not match it.
        """
        manifest = self.version_dir(table, version) / fmt.MANIFEST
        if not manifest.is_file():
            raise UserError(f"table '{table}' v{version} is not complete (no {manifest})")
        with manifest.open("rb") as f:
            # the identity of the very file hashed (fstat of the open file, not a second look at the path)
            ident = _stat_identity(os.fstat(f.fileno()))
            if ident is None:  # replaced since is_file (by hand): as no manifest
                raise UserError(f"table '{table}' v{version} is not complete ({manifest} is not a file)")
            key = (os.path.abspath(manifest), ident)
            with _VERSION_IDS_LOCK:
                found = _VERSION_IDS.get(key)
            if found is None:
                found = fmt.version_id(version, f)
                with _VERSION_IDS_LOCK:
                    if len(_VERSION_IDS) >= _VERSION_IDS_KEPT:
                        del _VERSION_IDS[next(iter(_VERSION_IDS))]
                    _VERSION_IDS[key] = found
            return found

    def checked_schema(self, table: str, version: int) -> TableSchema:
        """`manifest_files.checked_schema` of a version, checked once per Store while its schema.json holds the
        same bytes and checksums.json stays the same file; one that does not read is read (and recorded) again
        each time."""
        vdir = self.version_dir(table, version)
        ident = (_bytes(vdir / fmt.SCHEMA_JSON), _identity(vdir / fmt.CHECKSUMS))
        held = self._schemas.get((table, version))
        if held is not None and held[0] == ident:  # (one that did not read was never held)
            return held[1]
        schema = checked_schema(vdir)
        self._schemas[(table, version)] = (ident, schema)
        return schema

    def set_current(self, table: str, version: int, also: set[int] = frozenset()) -> None:
        """Point store.json at a complete version (atomic rewrite under the store lock); nothing is written (and no
        lock taken, so a read-only store stays usable) when it is current already. `also`: versions past it that
        were switched away from elsewhere (a pull's copies of those the URL lists: `fmt.table_entry`)."""
        if not fmt.is_complete(self.version_dir(table, version)):
            raise UserError(f"table '{table}' v{version} is not complete; cannot make it current")
        if self.tables().get(table) == version and not also:
            return
        from store.io_errors import writing

        with writing("store.json", self.root), fmt.flock(self.root / fmt.STORE_LOCK):
            rec = fmt.read_store_record(self.root)
            # a switch back to an older version records the one it leaves (gc's tell, `fmt.table_entry`)
            entry = fmt.table_entry(rec["tables"].get(table), version, also=also)
            if entry != rec["tables"].get(table):
                rec["tables"][table] = entry
                fmt.write_store_record(self.root, rec)

    def find_version(self, table: str, lineage: Lineage, serving: Iterable[Lineage] = ()) -> int | None:
        """A complete version built with exactly this lineage, or with one of `serving` (lineages whose versions
        hold all this one's would, e.g. settings that only add columns): the current one when it qualifies, else
        the newest of exactly this lineage, else the newest of `serving`."""
        wanted = [lineage.to_dict(), *(s.to_dict() for s in serving)]

        def serves(v: int) -> int | None:
            """The first of `wanted` that version v is of (0: exactly this lineage), None for none. A version whose
            schema.json does not read (or fails its checksum) is none: `checked_schema` records it as damaged, so
            it is treated as one `store verify` marked (the stage writes a new version) - raising here stopped
            every rerun of the stage at this version, whose only way out was that rerun."""
            try:
                recorded = self.checked_schema(table, v).lineage.to_dict()
            except DamagedData as e:
                log.warning("%s: not reused, recorded as damaged", e)
                return None
            return next((i for i, w in enumerate(wanted) if up_to_date.is_current(recorded, w)), None)

        matches = {v: rank for v in self.versions(table)
                   if fmt.is_complete(self.version_dir(table, v))
                   and not fmt.damaged_marker(self.root, table, v).exists() and (rank := serves(v)) is not None}
        if not matches:
            return None
        current = self.tables().get(table)
        exact = [v for v, rank in matches.items() if rank == 0]
        return current if current in matches else (exact or sorted(matches))[-1]

    def newest_complete(self, table: str) -> tuple[int, TableSchema] | None:
        """The newest complete version of `table` whose schema.json reads, with that schema (None: none): what a
        run that writes a new version compares itself with to say why (`up_to_date.lineage_differences`)."""
        for v in reversed(self.versions(table)):
            vdir = self.version_dir(table, v)
            if not fmt.is_complete(vdir):
                continue
            try:  # checked: a flipped bit that still parses must not stand for the version in what is compared
                return v, self.checked_schema(table, v)
            except UserError:  # unreadable or damaged (recorded, as a reader records it): the next older one
                continue
        return None

    # ------------------------------------------------------------ reading and writing

    def reader(self, table: str, version: int | None = None, on_damaged: str = "stop",
               max_open_shards: int = DEFAULT_MAX_OPEN_SHARDS) -> TableReader:
        current = version is None
        if current:
            tables = self.tables()
            if table not in tables:
                raise UserError(f"table '{table}' not in store {self.root} (tables: {sorted(tables) or 'none'}); "
                                "run the stage that writes it first")
            version = tables[table]
        vdir = self.version_dir(table, version)
        if not vdir.is_dir():
            # the current one gone (a folder deleted or not copied): nothing to carry forward, the stage writes it
            advice = (f"store.json names it as current, but its folder is gone: rerun the stage that writes "
                      f"'{table}'" if current else f"`pipeline store inspect {self.root}` lists the versions there")
            raise UserError(f"table '{table}' has no version v{version} in store {self.root}; {advice}")
        return TableReader(vdir, table, version, max_open_shards=max_open_shards, on_damaged=on_damaged)

    def join(self, *tables: str, split: str | None = None) -> JoinedTables:
        return JoinedTables({t: self.reader(t) for t in tables}, split, self.root)

    def writer(
        self, table: str, schema: TableSchema, rank: int = 0, world_size: int = 1, shard_size_mb: float = 256,
        version: int | None = None, remote_url: str | None = None, share: Sequence[str] | None = None,
        agree: Callable[[bool], bool] = lambda alone: alone,
    ) -> TableWriter:
        return TableWriter(self, table, schema, rank=rank, world_size=world_size, shard_size_mb=shard_size_mb,
                           version=version, remote_url=remote_url, share=share, agree=agree)

    # ------------------------------------------------------------ quarantine

    def add_quarantine(self, rows: Iterable[dict[str, Any]]) -> int:
        return quarantine.add_rows(self.root, rows)

    def add_quarantine_table(self, rows: pa.Table) -> int:
        """`add_quarantine` for rows already as text columns (`quarantine.add_table`)."""
        return quarantine.add_table(self.root, rows)

    def quarantine(self, columns: Iterable[str] | None = None) -> pa.Table:
        """STORE/quarantine.parquet's rows (`columns`: only those; `quarantine.read`)."""
        return quarantine.read(self.root, columns)


def _identity(path: Path) -> tuple[int, ...] | None:
    """`fmt.file_identity` of the file at `path` and its ctime (which no one sets back, as `os.utime` sets mtime);
    None where there is none."""
    try:
        return _stat_identity(os.stat(path))
    except OSError:
        return None


def _stat_identity(st: os.stat_result) -> tuple[int, ...] | None:
    """`_identity` of a stat already taken (`version_id`'s: of the very file it hashes)."""
    ident = fmt.file_identity(st)
    return None if ident is None else (*ident, st.st_ctime_ns)


def _bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None
