"""Finishing a table writer's version (store/writer.py): each rank's done file, then on rank 0 the commit of a
version on this disk - litter removed, checksums.json, manifest.parquet (presence = complete), store.json.
(Ranks on several nodes writing one version of a URL commit there instead: store/remote_parts.py.)"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import atomic_write
from schemas.errors import UserError
from schemas.view_lag import seen_in_time
from store import format as fmt
from store.integrity import write_version_checksums
from store.io_errors import writing
from store.manifest import merge_runs
from store.writer_open import index_paths

if TYPE_CHECKING:
    from store.writer import TableWriter


def mark_rank_done(writer: TableWriter, rejected: int = 0) -> None:
    """Write this rank's `rank-XX.done` (its shards all committed; the keys it was given and rejected, for the
    commit's `check_rows`); a rank of a URL's version uploads its part.

    On one shared folder it also records its committed shards' index names (those this node lists and those this
    session wrote): rank 0's view may lag and not list some of them, and a manifest built without them would lack
    their rows silently (`listed_indexes`). A rank of a URL's version records its files instead (`files`)."""
    done: dict[str, Any] = {"rank": writer.rank, "world_size": writer.world_size}
    if writer.given is not None:
        done.update(given=int(writer.given), rejected=int(rejected))
    if writer.remote_url is None:
        seen = {p.name for p in index_paths(writer.dir, writer.rank)}
        done["indexes"] = sorted(seen | writer.session_indexes)
    if writer.remote_url is not None:  # what rank 0 will list in checksums.json without reading the files
        if writer.given is None:  # rank 0 could not tell a part short of samples: a caller's error
            raise ValueError(f"rank {writer.rank} of table '{writer.table}' writes through its node's cache: set "
                             "writer.given (the keys it was given) before finish_rank")
        from store.remote_parts import rank_files

        done["files"] = rank_files(writer.dir, writer.rank)
    with writing(f"table '{writer.table}' v{writer.version}", writer.dir):
        fmt.atomic_write_json(writer.dir / fmt.rank_done_name(writer.rank), done)
    if writer.remote_url is not None:
        from store.remote_parts import upload_rank

        upload_rank(writer, done["files"])


class EmptyVersion(UserError):
    """A commit's refusal of a version with no rows (`allow_empty=False`: every input rejected), its folder (and a
    store URL's parts) removed already: a caller with other nodes' caches of it removes those too."""


def commit_local(writer: TableWriter, allow_empty: bool) -> int:
    """Rank 0, every rank done: merge the indexes into the manifest, commit it, make the version current, release
    the writer. Returns the version."""
    table, version, vdir = writer.table, writer.version, writer.dir
    missing = [r for r in range(writer.world_size) if not (vdir / fmt.rank_done_name(r)).is_file()]
    if missing:
        raise UserError(f"table '{table}' v{version}: ranks {missing} have not finished; "
                        "call commit() on rank 0 after a barrier")
    dones = [fmt.read_json(vdir / fmt.rank_done_name(r), "a rank-done file") for r in range(writer.world_size)]
    # each index read once: its rows and, from the same bytes, its CRC32C for checksums.json
    merged = merge_runs(listed_indexes(vdir, dones, f"table '{table}' v{version}"))
    if merged.num_rows == 0 and not allow_empty:
        # its folder goes too: left, it held the rank-done files of a run that failed, the fixed run took the
        # number after it, and `store inspect` listed it as incomplete until `store gc`
        discard_version(writer)
        raise EmptyVersion(f"table '{table}' v{version} would be empty: every input was rejected "
                        f"(reasons in {writer.store.root / 'quarantine.parquet'}); fix the inputs or the settings")
    check_rows(table, version, dones, merged.num_rows)
    for p in vdir.iterdir():  # temp files of killed writes: never part of a committed version
        if fmt.is_litter(p.name):
            p.unlink(missing_ok=True)
    with writing(f"the manifest of table '{table}' v{version}", vdir, need=2 * merged.nbytes):
        # streamed row group by row group, never whole in memory; checksums.json before the manifest's rename: a
        # complete version (manifest present) always has its checksums
        with atomic_write.atomic_file(vdir / fmt.MANIFEST) as f:
            written = merged.write(f)
            write_version_checksums(vdir, written.shards, written.measured, merged.measured,
                                    counts=written.counts)
        # version complete from here on
    fmt.crash_point("after_manifest")
    fmt.pause_point("commit_after_manifest")
    writer.store.set_current(table, version)
    writer.close()
    return version


def listed_indexes(vdir: Path, dones: list[dict[str, Any]], label: str) -> list[Path]:
    """Every shard index of the version that this node lists, once it lists each one the ranks' done files name
    (`indexes`; done files of older code name none, and are taken as they are): a lagging view is listed again a
    few times (`seen_in_time`), then the commit is refused rather than a manifest without those shards' rows."""
    named = {n for d in dones for n in d.get("indexes") or ()}
    paths: list[Path] = []

    def all_listed() -> bool:
        paths[:] = index_paths(vdir)
        return named <= {p.name for p in paths}

    if seen_in_time(all_listed):
        return paths
    missing = sorted(named - {p.name for p in paths})
    raise UserError(f"{label}: {len(missing)} committed shard(s) that the ranks' done files name are not listed in "
                    f"{vdir}, e.g. {missing[:3]} (this node's view of the shared folder lags, or they were removed); "
                    "nothing committed. Rerun: the version resumes from its committed shards")


def check_rows(table: str, version: int, dones: list[dict[str, Any]], rows: int, required: bool = False) -> None:
    """The last check before a manifest: the rows it commits plus the samples the ranks rejected must be the keys
    the ranks were given (summed over the ranks, as their rank-done files record them), or a table with samples
    missing would become current. Ranks whose writers were not told their keys (`writer.given`: writers other
    than the encoders, rank-done files of older code) are not judged, unless `required` (ranks writing through
    several caches always tell)."""
    if not dones or any("given" not in d for d in dones):
        if required:
            raise UserError(f"table '{table}' v{version}: a rank-done file does not record the keys its rank was "
                            "given (a part of another run?); nothing committed; rerun every node")
        return
    given, rejected = sum(int(d["given"]) for d in dones), sum(int(d.get("rejected", 0)) for d in dones)
    if rows + rejected != given:
        raise UserError(f"table '{table}' v{version}: {rows} rows plus {rejected} rejected samples, but the ranks were "
                        f"given {given} keys: samples {'missing' if rows + rejected < given else 'counted twice'}; "
                        "nothing committed. Rerun; if it recurs, remove the incomplete version (every node's cached "
                        f"{table}/v{version}, and `pipeline store gc` on a URL) and rerun")


def discard_version(writer: TableWriter) -> None:
    """The writer's in-progress version removed, then the writer closed (a version with nothing to commit: every
    input rejected, or a stage's rows equal to a complete version's). Renamed aside under the store lock first, as
    `store gc` does, so a kill midway leaves a `.v<N>.gc-deleting` folder that gc finishes, never a half version a
    rerun would resume; the next run of the table then takes this number, not the one after. A failed rename is
    one line (`UserError`): under a launcher the callers run this inside the ranks' agreement (`together`), and
    every rank stops with that line."""
    from store.gc import DELETING_SUFFIX

    vdir = writer.dir
    gone = vdir.with_name(f".{vdir.name}{DELETING_SUFFIX}")
    try:
        with fmt.flock(writer.store.root / fmt.STORE_LOCK):
            shutil.rmtree(gone, ignore_errors=True)
            try:
                os.rename(vdir, gone)
            except OSError as e:
                raise _not_discarded(writer, e) from e
            atomic_write.fsync_dir(vdir.parent)
        shutil.rmtree(gone, ignore_errors=True)
    finally:
        writer.close()


def _not_discarded(writer: TableWriter, error: OSError) -> UserError:
    """The line for a version folder `discard_version` could not rename aside (a read-only store, a folder held busy
    by another host's mount): nothing of it was removed, and it holds no committed data."""
    from store.io_errors import describe

    what = f"table '{writer.table}' v{writer.version}: its empty version folder"
    said = describe(error, f"{what} (renamed aside to remove it)", writer.dir.parent)
    if said is not None:
        return said
    return UserError(f"{what} {writer.dir} could not be renamed aside to remove it ({type(error).__name__}: "
                     f"{error}); nothing is committed there: remove it or run `pipeline store gc`, then rerun")
