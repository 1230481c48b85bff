"""Opening a table writer's version (store/writer.py): the (table, rank) lock, the version folder to resume or
create, and what a resumed folder already holds (committed keys, the next shard index)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.errors import UserError
from store import format as fmt
from store.io_errors import writing


def lock_rank(root: Path, table: str, rank: int) -> fmt.HeldLock:
    """The lock of this table's writer of `rank` (the table folder created when absent)."""
    with writing(f"table '{table}'", root / table):
        (root / table).mkdir(parents=True, exist_ok=True)
        # One writer per (table, rank): a second one fails here at once instead of interleaving shards.
        return fmt.HeldLock(root / table / f".write-r{rank:02d}.lock", holder=f"table '{table}' (rank {rank})")


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


def open_version(root: Path, table: str, want: dict[str, Any], version: int | None = None) -> tuple[int, Path]:
    """Resume the in-progress version with this exact schema + lineage (`want`), else create v<N+1>; `version`:
    that one (agreed on by ranks that do not share this folder: stages/encode/nodes.py), resumed or created.

    Done under the store lock so that ranks starting together agree on one folder.
    """
    with fmt.flock(root / fmt.STORE_LOCK):
        v = candidate_version(root, table, want) if version is None else version
        vdir = fmt.version_dir(root, table, v)
        if vdir.is_dir():
            if not fmt.is_complete(vdir) and (vdir / fmt.SCHEMA_JSON).is_file() and \
                    fmt.read_json(vdir / fmt.SCHEMA_JSON, "schema.json") == want:
                return v, vdir
            raise UserError(f"{vdir} is another writer's version (complete, or another schema), but the ranks "
                            f"agreed to write table '{table}' v{v}; remove that folder and rerun")
        vdir.mkdir(parents=True)
        try:
            fmt.atomic_write_json(vdir / fmt.SCHEMA_JSON, want)
        except BaseException:  # e.g. a full disk: no empty version folder left behind
            shutil.rmtree(vdir, ignore_errors=True)
            raise
        return v, vdir


def clean_uncommitted(vdir: Path, rank: int) -> None:
    """Drop this rank's half-written shards: temp files and tars whose index never got written."""
    prefix = f"shard-r{rank:02d}-"
    for p in vdir.glob(prefix + "*.tar.tmp"):
        p.unlink()
    for p in vdir.glob(f".{prefix}*.tmp-*"):  # an index write killed mid-way
        p.unlink(missing_ok=True)
    for p in vdir.glob(prefix + "*.tar"):
        if not (vdir / fmt.index_name(p.name)).is_file():
            p.unlink()
    (vdir / fmt.rank_done_name(rank)).unlink(missing_ok=True)


def index_paths(vdir: Path) -> list[Path]:
    """Every rank's shard indexes (an index present = its shard committed)."""
    return sorted(vdir.glob("shard-r*-*.index.parquet"))


def committed_keys(vdir: Path) -> set[str]:
    keys: set[str] = set()
    for p in index_paths(vdir):
        try:
            keys.update(pq.read_table(p, columns=["key"]).column("key").to_pylist())
        except (pa.ArrowException, OSError, ValueError, KeyError) as e:  # a damaged disk, or a hand edit
            shard = p.name.replace(".index.parquet", ".tar")
            raise UserError(f"{p}: the index of a committed shard of this unfinished version cannot be read "
                            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); delete it and {shard} "
                            "beside it, then rerun: their samples are written again") from None
    return keys


def next_shard_index(vdir: Path, rank: int, remote: bool) -> int:
    names = [p.name for p in vdir.glob(f"shard-r{rank:02d}-*.tar")]
    if remote:  # adopted indexes of shards that are only on the remote
        names += [p.name.replace(".index.parquet", ".tar") for p in vdir.glob(f"shard-r{rank:02d}-*.index.parquet")]
    idx = [int(m.group(2)) for name in names if (m := fmt.SHARD_RE.fullmatch(name))]
    return max(idx) + 1 if idx else 0
