"""Whether a complete version of an encoder's table serves this run as it is, beyond its lineage: one made under
on_damaged=skip that left damaged `images` samples out (quarantined as DAMAGED_INPUT) is current under skip only.

on_damaged is in no hash (a rerun or a resume may switch it). Under "stop" such a version is not reused as it
is: the run writes a new version that carries every sample forward from it (store/reuse.py) and reads only the
left-out ones, which stop the run if they are still damaged and are encoded if they were repaired. The answer is
derived from the store alone (its quarantine.parquet and the version's manifest), which every rank reads: the
ranks then agree on the version found as on any other (plan.open_job, output.agreed_found). As train's and
evaluate's `damaged_current`."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import UserError
from stages.encode.summary import DAMAGED_INPUT
from store import Store


def left_out(store: Store, table: str, version: int) -> list[str]:
    """The samples version `version` of `table` quarantined as damaged inputs and does not hold (sorted). A row
    of a sample the version holds anyway (quarantined by a run that failed before its commit, retried by the
    resume that committed) leaves nothing out."""
    from store.manifest_files import checked_manifest

    q = store.quarantine()
    if "table_version" not in q.column_names or not q.num_rows:
        return []
    mine = q.filter(pc.and_(pc.equal(q.column("reason"), DAMAGED_INPUT),
                            pc.equal(q.column("table_version"), f"{table}/v{version}")))
    keys = sorted(set(mine.column("key").to_pylist()) - {None})
    if not keys:
        return []  # the common case: the manifest is not read
    try:
        held = checked_manifest(store.version_dir(table, version), ["key"]).column("key").combine_chunks()
    except UserError:  # unreadable: it cannot show it holds them
        return keys
    wanted = pa.array(keys, pa.string())
    return wanted.filter(pc.invert(pc.is_in(wanted, value_set=held))).to_pylist()


def damaged_current(store: Store, table: str, version: int, on_damaged: str) -> bool:
    """Version `version` serves a run under `on_damaged`: "skip", or it left no damaged input out."""
    return on_damaged == "skip" or not left_out(store, table, version)
