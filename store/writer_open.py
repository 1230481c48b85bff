"""Opening a table writer's version (store/writer.py): the (table, rank) lock, the version folder to resume or
create, and what a resumed folder already holds (committed keys, the next shard index)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas.errors import UserError
from schemas.view_lag import VIEW_LAG_SECONDS, seen_in_time
from store import format as fmt
from store.io_errors import writing

# A version that ranks on several nodes write through their own caches of a store URL (store/remote_parts.py):
# how many ranks wrote its parts. Rank r's share of the keys depends on that number, and such a rank counts as done,
# uploads and adopts only its own shards: parts written by another number of ranks are another run.
WORLD_JSON = "world-size.json"


def lock_rank(root: Path, table: str, rank: int) -> fmt.HeldLock:
    """The lock of this table's writer of `rank` (the table folder created when absent)."""
    with writing(f"table '{table}'", root / table):
        try:
            (root / table).mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # there, but no folder seen here: a file, or rank 0 made it a moment ago (its
            # first version, `open_version`) and this node's view lags
            if (root / table).is_file() or not seen_in_time(lambda: (root / table).is_dir()):
                raise UserError(f"{root / table} is not a folder seen from this node: a file of that name (remove "
                                "it and rerun), or a folder another node made that this node's view did not show "
                                f"within {VIEW_LAG_SECONDS:.0f} s (a shared file system's attribute cache: rerun)"
                                ) from None
        # One writer per (table, rank): a second one fails here at once instead of interleaving shards.
        return fmt.HeldLock(_rank_lock(root, table, rank), holder=_rank_holder(table, rank))


def _rank_lock(root: Path, table: str, rank: int) -> Path:
    return root / table / f".write-r{rank:02d}.lock"


def _rank_holder(table: str, rank: int) -> str:
    return f"table '{table}' (rank {rank})"


def refuse_a_running_writer(root: Path, table: str, rank: int) -> None:
    """`lock_rank`'s refusal of a second writer of (table, rank), said before the model loads (an encoder: minutes)
    instead of at the writer, after it; nothing taken (`fmt.refuse_if_held`): `lock_rank` still takes the lock."""
    fmt.refuse_if_held(_rank_lock(root, table, rank), _rank_holder(table, rank))


def candidate_version(root: Path, table: str, want: dict[str, Any], world: int | None = None) -> int:
    """The version a writer with schema `want` opens: the newest in-progress one with that exact schema (resume),
    else one past the newest (call under the store lock; reads only). `world`: the ranks write through several
    caches, and only parts written by that many ranks are resumed (`parts_resumable`)."""
    versions = fmt.list_versions(root, table)
    for v in reversed(versions):
        vdir = fmt.version_dir(root, table, v)
        if fmt.is_complete(vdir) or not (vdir / fmt.SCHEMA_JSON).is_file():
            continue
        if world is not None and not parts_resumable(vdir, world):
            continue
        try:
            begun = fmt.read_json(vdir / fmt.SCHEMA_JSON, "schema.json")
        except UserError:  # damaged (a crash left it empty): not this schema, so a new version past it; raising
            continue       # here stopped every run of the stage at it, and gc removes it
        if begun == want:
            return v
    return (versions[-1] if versions else 0) + 1


def open_version(root: Path, table: str, want: dict[str, Any], version: int | None = None) -> tuple[int, Path]:
    """Resume the in-progress version with this exact schema + lineage (`want`), else create v<N+1>; `version`:
    that one (the ranks' version, which rank 0 opened: stages/encode/nodes.py), resumed or created.

    Done under the store lock so that ranks starting together agree on one folder. Rank 0 has just made the
    ranks' version, and another node's view of the table folder may not show it yet (a shared file system's
    attribute cache): its folder is then found by its creation failing (before, that `FileExistsError` ended the
    rank, the CLI calling the folder "a file") and its schema.json waited for (`seen_in_time`); refused as another
    writer's only once seen.
    """
    with fmt.flock(root / fmt.STORE_LOCK):
        v = candidate_version(root, table, want) if version is None else version
        vdir = fmt.version_dir(root, table, v)
        if not vdir.is_dir():
            try:
                vdir.mkdir(parents=True)
            except FileExistsError:  # there after all, unseen here: another node made it
                pass
            else:
                try:
                    fmt.atomic_write_json(vdir / fmt.SCHEMA_JSON, want)
                except BaseException:  # e.g. a full disk: no empty version folder left behind
                    shutil.rmtree(vdir, ignore_errors=True)
                    raise
                return v, vdir
        if not seen_in_time(lambda: (vdir / fmt.SCHEMA_JSON).is_file()):
            raise UserError(f"{vdir} holds no schema.json, though the ranks agreed to write table '{table}' v{v} "
                            f"there (waited {VIEW_LAG_SECONDS:.0f} s for this node to see it: a shared file "
                            "system's view that lags longer, or a writer killed as it made the folder); unless a "
                            "job writes that table now, remove that folder and rerun")
        if not fmt.is_complete(vdir) and fmt.read_json(vdir / fmt.SCHEMA_JSON, "schema.json") == want:
            return v, vdir
        raise UserError(f"{vdir} is another writer's version (complete, or another schema), but the ranks "
                        f"agreed to write table '{table}' v{v}; remove that folder and rerun")


def parts_world(vdir: Path) -> int | None:
    """The number of ranks that wrote the parts in `vdir` (`WORLD_JSON`); None when none is recorded."""
    if not (vdir / WORLD_JSON).is_file():
        return None
    try:
        return int(fmt.read_json(vdir / WORLD_JSON, WORLD_JSON)["world_size"])
    except (UserError, KeyError, TypeError, ValueError):  # damaged: whose parts they are is unknown
        return -1


def parts_resumable(vdir: Path, world: int) -> bool:
    """Ranks of `world` writing through several caches may resume `vdir`: its parts were written by that many
    ranks, or it holds none yet. Shards without a record (a version one cache shared by every rank wrote, or one
    written before the record existed) may hold any rank's share of any world size: another run."""
    recorded = parts_world(vdir)
    return recorded == world if recorded is not None else not any(vdir.glob("shard-r*"))


def record_world(vdir: Path, world: int, several_caches: bool) -> None:
    """Under the store lock, once the version is open. Several caches: refused unless `vdir`'s parts are this
    world's (`parts_resumable`), then recorded. One folder for every rank (a rank skips every rank's keys, rank 0
    merges every index): any world size resumes it, but a record of another one no longer holds."""
    with fmt.flock(vdir.parent.parent / fmt.STORE_LOCK):
        if not several_caches:
            if parts_world(vdir) not in (None, world):
                (vdir / WORLD_JSON).unlink(missing_ok=True)
            return
        if not parts_resumable(vdir, world):
            recorded = parts_world(vdir)
            by = "an unrecorded number of ranks" if recorded is None else f"{recorded} ranks"
            raise UserError(f"{vdir} holds parts written by {by}, not these {world}: another run, whose shards "
                            f"hold other ranks' shares; remove that folder and rerun")
        if parts_world(vdir) is None:
            fmt.atomic_write_json(vdir / WORLD_JSON, {"world_size": world})


def clean_temp_files(vdir: Path, rank: int) -> None:
    """Drop this rank's temp files from the version it resumes: never part of a committed shard, and only this
    rank's writer, whose lock is held, makes them.

    A tar without an index is left where it is: it may be a committed shard whose index this node does not see yet
    (a shared filesystem's view can lag on one node, hiding an index and the rank's done file alike - deleting such
    a tar lost a shard its index names). New shards take names past every shard and index of the rank
    (`next_shard_index`), and never a name taken (store/writer_shards.py), so a tar that really is uncommitted is
    only an unreferenced file: the commit neither lists nor ships it, and `store gc` removes it."""
    prefix = fmt.shard_prefix(rank)
    for p in vdir.glob(prefix + "*.tar.tmp"):
        p.unlink(missing_ok=True)
    for p in vdir.glob(f".{prefix}*.tmp-*"):  # an index write killed mid-way
        p.unlink(missing_ok=True)


def index_paths(vdir: Path, rank: int | None = None) -> list[Path]:
    """Every rank's shard indexes (an index present = its shard committed); `rank`: that rank's only."""
    pattern = "shard-r*-" if rank is None else fmt.shard_prefix(rank)
    return sorted(vdir.glob(f"{pattern}*.index.parquet"))


BATCH = 1024  # index files filtered at once: one hash table of `among` per batch (per file: 15x slower, 1M keys)


def committed_keys(indexes: list[Path], among: pa.Array | None = None) -> set[str]:
    """The keys of these shard indexes; `among`: only those of them in it (a set of its size, not every rank's)."""
    keys: set[str] = set()
    for i in range(0, len(indexes), BATCH):
        keys.update(_kept(pa.concat_arrays([index_keys(p) for p in indexes[i : i + BATCH]]), among).to_pylist())
    return keys


def _kept(keys: pa.Array, among: pa.Array | None) -> pa.Array:
    return keys if among is None else keys.filter(pc.is_in(keys, value_set=among))


def index_keys(p: Path) -> pa.Array:
    """The key column of one committed shard's index (pq.ParquetFile: a third of read_table's cost per file, and a
    resume reads thousands of them)."""
    try:
        with pq.ParquetFile(p) as f:
            return f.read(columns=["key"], use_threads=False).column("key").combine_chunks().cast(pa.string())
    except (pa.ArrowException, OSError, ValueError, KeyError) as e:  # a damaged disk, or a hand edit
        shard = p.name.replace(".index.parquet", ".tar")
        raise UserError(f"{p}: the index of a committed shard of this unfinished version cannot be read "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); delete it and {shard} "
                        "beside it, then rerun: their samples are written again") from None


def rank_of_index(p: Path) -> int | None:
    m = fmt.SHARD_RE.fullmatch(p.name.replace(".index.parquet", ".tar"))
    return int(m.group(1)) if m else None


def committed_in_share(indexes: list[Path], rank: int, world_size: int, share: pa.Array,
                       agree: Callable[[bool], bool]) -> set[str]:
    """The keys of `share` (rank's part of the work, disjoint from every other rank's) that these indexes hold.

    Every rank reads its own indexes only when that is enough to know: every rank's own indexes hold keys of its
    own share alone, and no index of a rank outside this world exists - then a key of this share can only be in
    this rank's indexes. That is the usual resume (the same world size, hence the same shares); `agree` turns
    this rank's verdict into every rank's (all ranks call it together). Otherwise (a resume with another world
    size: the shares moved) every rank reads every index, keeping only its share's keys."""
    ranks = [rank_of_index(p) for p in indexes]
    own = pa.concat_arrays([index_keys(p) for p, r in zip(indexes, ranks) if r == rank] or [pa.array([], pa.string())])
    alone = all(r is not None and r < world_size for r in ranks) and \
        pc.all(pc.is_in(own, value_set=share)).as_py() in (True, None)  # None: no rows
    if agree(alone):
        return set(own.to_pylist())
    keys = committed_keys([p for p, r in zip(indexes, ranks) if r != rank], among=share)
    keys.update(_kept(own, share).to_pylist())  # read above already
    return keys


def next_shard_index(vdir: Path, rank: int) -> int:
    """One past every shard and shard index of this rank that this view lists: an index without its tar is a shard
    adopted from a store URL, a tar without its index a shard whose index is not seen yet (or an uncommitted one)."""
    idx = [int(m.group(2)) for p in vdir.glob(f"{fmt.shard_prefix(rank)}*")
           if (shard := fmt.shard_of(p.name)) is not None and (m := fmt.SHARD_RE.fullmatch(shard))]
    return max(idx) + 1 if idx else 0
