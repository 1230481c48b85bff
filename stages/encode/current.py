"""Whether a complete version of an encoder's table serves this run as it is, beyond its lineage: one made under
on_damaged=skip that left damaged `images` samples out (quarantined as DAMAGED_INPUT) is current under skip only.

on_damaged is in no hash (a rerun or a resume may switch it). Under "stop" such a version is not reused as it
is: the run writes a new version that carries every sample forward from it (store/reuse.py) and reads only the
left-out ones, which stop the run if they are still damaged and are encoded if they were repaired. The answer is
derived from the store alone (its quarantine.parquet and the version's manifest), which every rank reads: the
ranks then agree on the version found as on any other (plan.open_job, output.agreed_found). A store URL's complete
version that is not current there, which a cache need not hold (`left_out_on_remote`), is judged from the remote's
manifest and quarantine rows and each node's cache's rows, the ranks agreeing (nodes.writer_place). One rule with
train's and evaluate's: `schemas.up_to_date.serves_on_damaged`."""

from __future__ import annotations

from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc

from schemas import up_to_date as current
from schemas.errors import UserError
from schemas.stage import few
from stages.encode.summary import DAMAGED_INPUT
from store import Store


def left_out(store: Store, table: str, version: int, remote_rows: bool = False) -> list[str]:
    """The samples version `version` of `table` quarantined as damaged inputs and does not hold (sorted). A row
    of a sample the version holds anyway (quarantined by a run that failed before its commit, retried by the
    resume that committed) leaves nothing out. `remote_rows` (the one rank that reads them): for a copy of a store
    URL's version in its cache, the remote's rows too, which a warm open of the cache does not pull: a version
    refused by them (nodes.writer_place) and opened in the cache to carry from passed for current at the cache's
    next run, and was made current on the remote."""
    from store.manifest_files import checked_manifest
    from store.remote_parts import remote_quarantine, source_url
    from store.remote_shards import is_lazy

    keys = _damaged_inputs(store.quarantine(_COLUMNS), table, version)
    url = source_url(store.root) if remote_rows else None
    if url is not None and is_lazy(store.version_dir(table, version)):
        keys |= _damaged_inputs(remote_quarantine(url), table, version)
    return _not_held(keys, lambda: checked_manifest(store.version_dir(table, version), ["key"]).column("key"))


def left_out_on_remote(store: Store, url: str, table: str, version: int, remote_rows: bool) -> list[str]:
    """`left_out` of a complete version the store URL `url` holds but its cache `store` need not (the remote's
    `committed`, store/remote_parts.on_remote): the rows of the cache's quarantine.parquet (this node's: merged
    into the remote's after the commit's store.json swap, so a lost swap left them here alone) and, `remote_rows`,
    the remote's (other caches' runs); the keys of the remote's manifest."""
    from store.remote_parts import manifest_keys, remote_quarantine

    keys = _damaged_inputs(store.quarantine(_COLUMNS), table, version)
    if remote_rows:
        keys |= _damaged_inputs(remote_quarantine(url), table, version)
    return _not_held(keys, lambda: manifest_keys(url, table, version))


_COLUMNS = ("key", "reason", "table_version")  # what `_damaged_inputs` compares (every rank reads them)


def _damaged_inputs(q: pa.Table, table: str, version: int) -> set[str]:
    """The keys quarantine rows `q` record as damaged inputs of version `version` of `table`."""
    if "table_version" not in q.column_names or not q.num_rows:
        return set()
    mine = q.filter(pc.and_(pc.equal(q.column("reason"), DAMAGED_INPUT),
                            pc.equal(q.column("table_version"), f"{table}/v{version}")))
    return set(mine.column("key").to_pylist()) - {None}


def _not_held(keys: set[str], held: Callable[[], pa.ChunkedArray]) -> list[str]:
    """`keys` the version's manifest (`held()`: its key column) lacks, sorted."""
    if not keys:
        return []  # the common case: the manifest is not read
    try:
        there = held().combine_chunks()
    except UserError:  # unreadable: it cannot show it holds them
        return sorted(keys)
    wanted = pa.array(sorted(keys), pa.string())
    return wanted.filter(pc.invert(pc.is_in(wanted, value_set=there))).to_pylist()


def serving_version(store: Store, stage: str, table: str, found: int | None, on_damaged: str,
                    say: bool = False, left: Callable[[], list[str]] | None = None,
                    remote_rows: bool = False) -> int | None:
    """`found` (a complete version of this run's lineage), or None when it left damaged inputs out and this run is
    under on_damaged=stop (`schemas.up_to_date.serves_on_damaged`): the run then carries its samples forward into a
    new version and reads the left-out ones again. `say`: print why (one rank). The one check of both looks for a
    reusable version, before the model loads (plan.open_job) and after (output: one committed meanwhile), and of a
    store URL's complete version that is not current there (nodes.writer_place). `left`: the version's left-out
    samples (default: `left_out` in `store`, with the remote's rows on the rank that reads them: `remote_rows`)."""
    if found is None:
        return None
    keys: list[str] = []

    def read() -> list[str]:  # kept for the message
        keys[:] = left() if left is not None else left_out(store, table, found, remote_rows)
        return keys

    if current.serves_on_damaged(on_damaged, read):
        return found
    if say:
        say_left_out(stage, table, found, keys)
    return None


def say_left_out(stage: str, table: str, found: int, shown: list[str], count: int | None = None) -> None:
    """Print why version `found` does not serve a run under on_damaged=stop: the samples it left out (`shown`, of
    `count` in all; default all of them)."""
    from tqdm.auto import tqdm

    count = len(shown) if count is None else count
    listed = few(shown) if count == len(shown) else ", ".join(sorted(shown)[:10]) + " …"
    section = stage.replace("-", "_")
    tqdm.write(f"{stage}: table '{table}' v{found} left out {count} damaged input sample(s) under "
               f"{section}.on_damaged=skip ({listed}); {section}.on_damaged is stop now: "
               "a new version carries its samples forward and reads those again")
