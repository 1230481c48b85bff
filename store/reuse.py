"""Per-sample reuse across table versions (docs/store-format.md, "Feature lineage and carried-forward samples").

A sample's stored features are determined by its *feature lineage* - a hash of the writing stage, its
feature-relevant settings, the fingerprint of the model components it loads and its code revision (recorded in
`schema.json` as `attrs.feature_lineage`, computed by `schemas.lineage.feature_lineage`) - and by the sample's own content key. When a stage builds a new
version, every key already held by a complete version with the same feature lineage is carried forward: its
shard is hard-linked into the new version and its manifest rows are copied with the view columns (`split`,
`source`) taken from the current input. Nothing is recomputed, and the new version is self-contained (its own
folder holds every shard it references), so readers, `verify` and `gc` need no cross-version logic.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas import up_to_date
from schemas.errors import UserError
from schemas.newer import WrittenByNewer
from store import format as fmt
from store.manifest_files import checked_manifest, read_schema
from store.row_rule import RowRule

if TYPE_CHECKING:
    from store.reader import TableReader
    from store.store import Store
    from store.writer import TableWriter

FEATURE_LINEAGE_ATTR = "feature_lineage"
# the version's feature lineage as its stage's revision before its latest fixes computed it (schemas/fixes.py)
LINEAGE_BEFORE_FIXES_ATTR = "feature_lineage_before_fixes"

# feature lineage -> stored rows -> "does a fix made since change each?" (schemas/fixes.py, for whole columns:
# store/row_rule.py): a version recorded under the lineage before a fix holds the features wanted only for the
# rows the fix leaves unchanged
Changed = dict[str, Callable[[pa.Table], np.ndarray]]


def _unchanged(rows: pa.Table, changed: Callable[[pa.Table], np.ndarray]) -> pa.Table:
    return rows.filter(pa.array(~changed(rows), pa.bool_()))


def marked_versions(store: Store, table: str) -> list[int]:
    """Versions of `table` recorded as damaged (`v<N>.damaged.json`: by a reader, `store verify` or repair)."""
    return [v for v in store.versions(table) if fmt.damaged_marker(store.root, table, v).exists()]


def checking_needed(store: Store, table: str) -> bool:
    """Carried samples are checked byte by byte (and their shards whole) while `store repair` runs a stage, or
    when a version of the table is recorded as damaged: its shards may be shared by hard link with other
    versions, so their damage must not be carried forward."""
    from store import repair_context

    return repair_context.active() or bool(marked_versions(store, table))


_SCANS: dict[tuple[str, int], Any] = {}  # (version folder, marker mtime) -> store.repair.TablePlan


def damage_scan(store: Store, table: str, version: int):
    """Every sample and shard of a version checked (`store.repair.scan_table`: a full read), once per process
    and marker state; damage found in a version not yet recorded as damaged is recorded."""
    from store import integrity
    from store.repair import TablePlan, scan_table

    vdir = store.version_dir(table, version)
    marker = fmt.damaged_marker(store.root, table, version)

    def stamp() -> tuple[str, int]:
        return str(vdir), marker.stat().st_mtime_ns if marker.exists() else 0

    if stamp() not in _SCANS:
        try:
            plan = scan_table(store.root, table, version)
        except WrittenByNewer as e:  # not this code's to read: nothing carried from it, and no damage recorded
            plan = TablePlan(table, version, unrepairable=str(e))
        # repair's scan records nothing: a manifest it could not read (rebuilt from the shard indexes, or not) is
        # recorded with the line a reader's view records on meeting it (schema.json and checksums.json were read
        # checked, and recorded, by the callers' reader open before this scan)
        problems = [plan.manifest_problem] if plan.manifest_problem else []
        if plan.damaged or problems:
            integrity.record_damage(vdir, plan.damaged, problems=problems)
        _SCANS[stamp()] = plan
    return _SCANS[stamp()]


def same_features(attrs: dict[str, Any], accepted: Iterable[str]) -> bool:
    """A version whose samples are the features wanted: its recorded feature lineage is one of `accepted`
    (`schemas.up_to_date`, the one rule every reuse goes through)."""
    recorded = {FEATURE_LINEAGE_ATTR: attrs.get(FEATURE_LINEAGE_ATTR)}
    return any(up_to_date.is_current(recorded, {FEATURE_LINEAGE_ATTR: h}) for h in accepted)


def reusable(store: Store, table: str, lineage_hash: str | Iterable[str], keys: Iterable[str],
             changed: Changed | None = None, lineages: dict[int, str | None] | None = None) -> dict[int, pa.Table]:
    """version -> manifest rows of the wanted keys found there; complete versions with this feature lineage (or
    any of these: the same features hashed by an earlier scheme), newest first, each key taken once. A version
    whose lineage is in `changed` (one from before a fix) gives only the rows that fix leaves unchanged (the
    others are looked for in older versions, else recomputed). `lineages`, where given, is filled with each
    returned version's feature lineage.

    Integrity: a version's manifest is read checked against its checksums.json (a damaged one is skipped);
    samples of shards missing or of the wrong size are not carried. When `checking_needed` (store repair runs
    a stage, or a version of the table is recorded as damaged) every version is scanned in full first
    (`damage_scan`): its damaged samples are left out (so recomputed), and `carry_forward` copies the intact
    samples of damaged shards instead of linking the shard. Otherwise that full read is skipped: a carried
    sample keeps its recorded CRC, so `store verify` and the checked reader still find damage."""
    checking = checking_needed(store, table)
    accepted = {lineage_hash} if isinstance(lineage_hash, str) else set(lineage_hash)
    wanted = pa.array(sorted(set(keys)), pa.string())
    found: dict[int, pa.Table] = {}
    for v in reversed(store.versions(table)):
        if len(wanted) == 0:
            break
        read = _wanted_rows(store, table, v, accepted, wanted)
        if read is None:
            continue
        manifest, lineage, bad_shards = read
        rows = _intact(store, table, v, manifest, checking, bad_shards)
        if rows is None:
            continue
        fix = (changed or {}).get(lineage)
        if fix is not None and rows.num_rows:
            rows = _unchanged(rows, fix)
        if rows.num_rows:
            found[v] = rows
            if lineages is not None:
                lineages[v] = lineage
            wanted = wanted.filter(pc.invert(pc.is_in(wanted, value_set=rows.column("key"))))
    return found


def _wanted_rows(store: Store, table: str, version: int, accepted: set[str],
                 wanted: pa.Array) -> tuple[pa.Table, str | None, Any] | None:
    """(the manifest rows of the `wanted` keys, the feature lineage, the shards missing or of the wrong size) of a
    complete `version` with one of the `accepted` lineages; None: another lineage, incomplete or unreadable."""
    from store.integrity import DamagedData
    from store.reader import TableReader

    vdir = store.version_dir(table, version)
    if not fmt.is_complete(vdir):
        return None
    try:  # the lineage first, from schema.json alone: another version's manifest and shards are never read
        # (unchecked: a pre-filter; the reader's open checks schema.json before a row is carried, and records)
        if not same_features(read_schema(vdir).attrs, accepted):
            return None
        reader = TableReader(vdir, table, version, on_damaged="skip")
    except (DamagedData, UserError):  # unreadable: recompute instead of carrying
        return None
    try:
        if not same_features(reader.schema.attrs, accepted):
            return None
        # the wanted keys' rows only, found in the key column the reader holds: parsing every column of the whole
        # manifest to keep a rank's share held ~500 MB at 1M samples in every encode rank (bench/reuse_rows.py)
        at = reader.view.keys.rows_of_keys(wanted)
        return (reader.view.table_at(np.unique(at[at >= 0])), reader.schema.attrs.get(FEATURE_LINEAGE_ATTR),
                reader.bad_shards)
    except DamagedData:  # a manifest page that does not decode (recorded by the view): recomputed, as above
        return None
    finally:
        reader.close()


def _intact(store: Store, table: str, version: int, manifest: pa.Table, checking: bool,
            bad_shards) -> pa.Table | None:
    """The rows of `manifest` whose samples may be carried: when `checking`, those the full scan of the version
    found intact (None: nothing of it is carried, its manifest being unrepairable or rebuilt); else those of the
    shards present at their size (`bad_shards` left out)."""
    if checking:
        plan = damage_scan(store, table, version)
        if plan.unrepairable or plan.manifest_rebuilt:
            return None
        return _without(manifest, "key", plan.damaged)
    return _without(manifest, "shard", bad_shards)


def _without(rows: pa.Table, column: str, values) -> pa.Table:
    """`rows` but those whose `column` holds one of `values`."""
    if not values:
        return rows
    return rows.filter(pc.invert(pc.is_in(rows.column(column), value_set=pa.array(sorted(values), pa.string()))))


def reusable_keys(store: Store, table: str, lineage_hash: str, column: str,
                  changed: RowRule | None = None) -> dict[str, object]:
    """key -> value of `column` (None where a version lacks it) for every key held by a complete version of
    `table` with this feature lineage (damaged samples left out when `checking_needed`; with `changed`, the rows
    a fix made since changes left out too)."""
    checking = checking_needed(store, table)
    out: dict[str, object] = {}
    for v in store.versions(table):
        vdir = store.version_dir(table, v)
        try:  # checked: a flipped bit that still parses could name this lineage, and its rows' values be reused
            if not fmt.is_complete(vdir) or not same_features(store.checked_schema(table, v).attrs,
                                                              (lineage_hash,)):
                continue
        except UserError:  # damaged (recorded, as a reader records it) or unreadable: recomputed, not reused
            continue
        damaged: dict[str, str] = {}
        if checking:
            plan = damage_scan(store, table, v)
            if plan.unrepairable or plan.manifest_rebuilt:
                continue
            damaged = plan.damaged
        try:
            m = checked_manifest(vdir, list(dict.fromkeys(["key", column, *(changed.columns if changed else ())])),
                                 record=True)
        except UserError:  # damaged (DamagedData, recorded) or unreadable: recomputed, not carried, as `reusable`
            continue
        if changed is not None:
            m = _unchanged(m, changed)
        values = m.column(column).to_pylist() if column in m.column_names else [None] * m.num_rows
        out.update((k, val) for k, val in zip(m.column("key").to_pylist(), values) if k not in damaged)
    return out


def unchanged_by_fixes(store: Store, table: str, version: int, check: str, scan: Callable[[], bool]) -> bool:
    """Does no sample of this complete version change under the fixes `check` names (an id of what is wanted
    now: its lineage)? `scan()` answers by reading every row's metadata; a yes is recorded next to the version
    (`v<N>.unchanged.json`, atomic: a kill leaves the old record or the new) with the manifest's hash, so a rerun
    of an unchanged store reads no rows. A record of another manifest (a version rebuilt under that number) or
    without this check is not trusted; a store that cannot be written to scans every time."""
    path = fmt.unchanged_marker(store.root, table, version)
    version_id = store.version_id(table, version)
    try:
        rec = fmt.read_json(path, "unchanged-by-fixes record") if path.is_file() else {}
        checks = list(rec.get("checks", [])) if rec.get("version_id") == version_id else []
    except (UserError, AttributeError, TypeError):  # a damaged or hand-edited record: scanned again
        checks = []
    if check in checks:
        return True
    if not scan():
        return False
    try:
        fmt.atomic_write_json(path, {"version_id": version_id, "checks": [*checks[-7:], check]})
    except OSError:  # a read-only store: the answer stands, only not remembered
        pass
    return True


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
    commit those rows (view columns replaced from `views`). Returns the number of samples carried. When
    `checking_needed`, a shard the damage scan did not find intact is not linked: its (intact, checked)
    samples are copied into the writer's own shards."""
    from tqdm.auto import tqdm

    from store.manifest import rows_by_shard

    src_dir = fmt.version_dir(writer.store.root, writer.table, src_version)
    parts = rows_by_shard(with_columns(rows, views or {}))  # grouped by one sort: a filter per shard was minutes
    n = 0
    with source_held(writer.store.root, writer.table, src_version, f"carry forward into '{writer.table}'",
                     "carry forward"):
        plan = damage_scan(writer.store, writer.table, src_version) if checking_needed(writer.store, writer.table) \
            else None
        for shard, part in tqdm(parts.items(), desc=f"carry forward '{writer.table}'", unit="shard", leave=False):
            if plan is None or shard in plan.intact_shards:
                writer.add_linked_shard(Path(src_dir) / shard, part)
            else:
                _copy_samples(writer, src_dir, src_version, part)
            n += part.num_rows
    return n


@contextmanager
def source_held(root: str | Path, table: str, version: int, holder: str, taking: str) -> Iterator[None]:
    """A read lease on `table` v`version` while a stage takes samples from it (`taking`: "carry forward", ...): a
    `store gc` meanwhile keeps the version (store/lease.py); refused in one line where gc removed it after the stage
    chose it."""
    from store.lease import hold

    lease = hold(root, {table: version}, holder)
    try:
        if lease.version(table) is None:
            raise UserError(f"table '{table}' v{version} was removed (`store gc`) while this stage chose samples to "
                            f"{taking} from it; rerun the stage (it resumes)")
        yield
    finally:
        lease.release()


@contextmanager
def source_reader(root: str | Path, table: str, version: int, holder: str, taking: str) -> Iterator[TableReader]:
    """`table` v`version` open checked (a damaged sample raises `DamagedData` when read) under `source_held`."""
    from store.reader import TableReader

    with source_held(root, table, version, holder, taking):
        reader = TableReader(fmt.version_dir(root, table, version), table, version, on_damaged="skip")
        try:
            yield reader
        finally:
            reader.close()


def _copy_samples(writer: TableWriter, src_dir: Path, src_version: int, rows: pa.Table) -> None:
    """Re-add samples from their checked bytes (the reader refuses damaged ones), meta from `rows`."""
    from store.manifest import RESERVED_COLUMNS
    from store.reader import TableReader

    reader = TableReader(src_dir, writer.table, src_version, on_damaged="skip")
    reader.salvages = True  # the intact samples of a shard cut short too (a plain reader refuses the whole shard)
    try:
        for row in rows.to_pylist():
            s = reader.get(row["key"])
            meta = {c: v for c, v in row.items() if c not in RESERVED_COLUMNS and v is not None}
            writer.add(row["key"], tensors=s["tensors"], files=s["files"], meta=meta)
    finally:
        reader.close()
