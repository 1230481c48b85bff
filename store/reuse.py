"""Per-sample reuse across table versions (docs/store-format.md, "Feature lineage and carried-forward samples").

A sample's stored features are determined by its *feature lineage* - a hash of the writing stage, its
feature-relevant settings, the fingerprint of the model components it loads and its code revision (recorded in
`schema.json` as `attrs.feature_lineage`) - and by the sample's own content key. When a stage builds a new
version, every key already held by a complete version with the same feature lineage is carried forward: its
shard is hard-linked into the new version and its manifest rows are copied with the view columns (`split`,
`source`) taken from the current input. Nothing is recomputed, and the new version is self-contained (its own
folder holds every shard it references), so readers, `verify` and `gc` need no cross-version logic.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas.errors import UserError
from store import format as fmt
from store.reader import read_schema

if TYPE_CHECKING:
    from store.store import Store
    from store.writer import TableWriter

FEATURE_LINEAGE_ATTR = "feature_lineage"


def feature_lineage(stage: str, settings: Any, components: str = "", code_version: str = "",
                    upstream: str = "") -> str:
    """One hash of what determines a sample's features besides its key: stage, feature settings (JSON-able),
    component fingerprint, code revision, and the upstream table's feature lineage."""
    blob = json.dumps({"stage": stage, "settings": settings, "components": components, "code": code_version,
                       "upstream": upstream}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def reusable(store: Store, table: str, lineage_hash: str, keys: Iterable[str]) -> dict[int, pa.Table]:
    """version -> manifest rows of the wanted keys found there; complete versions with this feature lineage,
    newest first, each key taken once.

    Integrity: versions marked damaged by `store repair` are never used; a version's manifest is read checked
    against its checksums.json (a damaged one is skipped); samples of shards missing or of the wrong size are
    not carried. While `store repair` runs a stage, every sample to carry is also checked byte by byte, so a
    damaged shard shared by hard link with an older version is never carried back (outside repair that full
    read is skipped: a carried sample keeps its recorded CRC, so `store verify` still finds damage)."""
    from store import repair_context
    from store.integrity import DamagedData
    from store.reader import TableReader

    checking = repair_context.active()
    wanted = pa.array(sorted(set(keys)), pa.string())
    found: dict[int, pa.Table] = {}
    for v in reversed(store.versions(table)):
        if len(wanted) == 0:
            break
        vdir = store.version_dir(table, v)
        if not fmt.is_complete(vdir) or fmt.damaged_marker(store.root, table, v).exists():
            continue
        try:
            reader = TableReader(vdir, table, v, on_damaged="skip")
        except (DamagedData, UserError):  # unreadable: recompute instead of carrying
            continue
        if reader.schema.attrs.get(FEATURE_LINEAGE_ATTR) != lineage_hash:
            continue
        manifest = reader.manifest
        keep = pc.is_in(manifest.column("key"), value_set=wanted)
        if reader.bad_shards:
            keep = pc.and_(keep, pc.invert(pc.is_in(manifest.column("shard"),
                                                    value_set=pa.array(sorted(reader.bad_shards), pa.string()))))
        rows = manifest.filter(keep)
        if checking and rows.num_rows:
            intact = [reader.damaged(k) is None for k in rows.column("key").to_pylist()]
            rows = rows.filter(pa.array(intact, pa.bool_()))
        reader.close()
        if rows.num_rows:
            found[v] = rows
            wanted = wanted.filter(pc.invert(pc.is_in(wanted, value_set=rows.column("key"))))
    return found


def reusable_keys(store: Store, table: str, lineage_hash: str, column: str) -> dict[str, Any]:
    """key -> value of `column` (None where a version lacks it) for every key held by a complete version of
    `table` with this feature lineage."""
    out: dict[str, Any] = {}
    for v in store.versions(table):
        vdir = store.version_dir(table, v)
        if fmt.damaged_marker(store.root, table, v).exists():
            continue
        if fmt.is_complete(vdir) and read_schema(vdir).attrs.get(FEATURE_LINEAGE_ATTR) == lineage_hash:
            names = pq.read_schema(vdir / fmt.MANIFEST).names
            m = pq.read_table(vdir / fmt.MANIFEST, columns=["key"] + ([column] if column in names else []))
            values = m.column(column).to_pylist() if column in names else [None] * m.num_rows
            out.update(zip(m.column("key").to_pylist(), values))
    return out


def with_columns(rows: pa.Table, values: dict[str, dict[str, Any]]) -> pa.Table:
    """`rows` with the given meta columns replaced per key (values: column -> {key: value})."""
    keys = rows.column("key").to_pylist()
    for name, by_key in values.items():
        if name not in rows.column_names:
            continue
        i = rows.schema.get_field_index(name)
        field = rows.schema.field(i)
        rows = rows.set_column(i, field, pa.array([by_key[k] for k in keys], field.type))
    return rows


def carry_forward(writer: TableWriter, src_version: int, rows: pa.Table,
                  views: dict[str, dict[str, Any]] | None = None) -> int:
    """Link every shard of `rows` (rows of `src_version` of the writer's table) into the writer's version and
    commit those rows (view columns replaced from `views`). Returns the number of samples carried."""
    from store.lease import hold

    src_dir = fmt.version_dir(writer.store.root, writer.table, src_version)
    rows = with_columns(rows, views or {})
    shards = rows.column("shard")
    n = 0
    # A read lease while linking: a `store gc` meanwhile keeps the source version (store/lease.py).
    lease = hold(writer.store.root, {writer.table: src_version}, f"carry forward into '{writer.table}'")
    try:
        if lease.version(writer.table) is None:
            raise UserError(f"table '{writer.table}' v{src_version} was removed (`store gc`) while this stage chose "
                            "samples to carry forward from it; rerun the stage (it resumes)")
        for shard in sorted(set(shards.to_pylist())):
            part = rows.filter(pc.equal(shards, shard))
            writer.add_linked_shard(Path(src_dir) / shard, part)
            n += part.num_rows
    finally:
        lease.release()
    return n
