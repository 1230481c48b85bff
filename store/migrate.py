"""`pipeline migrate v1-to-v2`: each table whose current version is schema v1 gets a new v2 version.

Steps per table, each safe to be killed at (the store stays valid in the old or the new version):
  1. build `v<N>.migrating/`: shards hard-linked from the old version (no tensor copied), schema.json (v2,
     `attrs.migrated_from`), manifest = old manifest + derived `img_shapes`;
  2. rename it to `v<N>/` (atomic; a complete version that is not yet current);
  3. verify it; 4. switch store.json to it (atomic). A rerun finds the finished `v<N>` and goes on from step 3.
Leftover `*.migrating` folders from a kill are removed on the next run.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa

from schemas import atomic_write
from schemas.errors import UserError
from schemas.img_shapes import img_shapes_from_v1
from schemas.table import SCHEMA_V1, SCHEMA_V2, FieldSpec, TableSchema
from schemas.units import count_text
from store import format as fmt
from store.integrity import DamagedData, write_version_checksums
from store.manifest_files import checked_manifest, checked_schema
from store.store import Store
from store.version_counts import counted
from store.verify import verify_version

MIGRATING_SUFFIX = ".migrating"
log = logging.getLogger("store")


@dataclass
class Step:
    table: str
    old: int
    new: int
    samples: int
    shards: int
    reuse: bool  # a previous (killed) run already built the new version


def plan(st: Store, record: bool = True) -> list[Step]:
    """`record=False` (a dry run): a damaged schema.json is skipped alike but not recorded."""
    steps = []
    for table, cur in st.tables().items():
        old_dir = st.version_dir(table, cur)
        s = _intact_schema(old_dir, "not migrated", record)
        if s is None or s.schema_version != SCHEMA_V1:  # damaged: its stage's rerun writes a v2 version
            continue
        manifest = checked_manifest(old_dir, ["key", "shard"])
        done = _finished_migration(st, table, cur, record)
        new = done if done is not None else max(st.versions(table)) + 1
        steps.append(Step(table, cur, new, manifest.num_rows, len(set(manifest.column("shard").to_pylist())),
                          done is not None))
    return steps


def _finished_migration(st: Store, table: str, old: int, record: bool) -> int | None:
    for v in st.versions(table):
        vdir = st.version_dir(table, v)
        if fmt.is_complete(vdir):
            s = _intact_schema(vdir, "not taken as the finished migration", record)  # whose verify failed every rerun
            if s is not None and s.schema_version == SCHEMA_V2 and s.attrs.get("migrated_from") == old:
                return v
    return None


def _intact_schema(vdir: Path, what: str, record: bool) -> TableSchema | None:
    """The version's schema.json checked against its checksums.json (a flipped bit that still parses decides
    nothing here); None, with one warning line, for a damaged one (recorded, as a reader records it)."""
    try:
        return checked_schema(vdir, record=record)
    except DamagedData as e:
        log.warning("%s: %s%s", e, what, ", recorded as damaged" if record else "")
        return None


def migrate_v1_to_v2(root: Path, dry_run: bool = False, echo: Callable[[str], None] = print) -> list[Step]:
    st = Store(root, create=False)
    steps = plan(st, record=not dry_run)
    if not steps:
        echo("nothing to do: every table's current version is schema v2")
        return []
    for s in steps:
        how = ("already built, will verify and switch" if s.reuse
               else f"{count_text(s.shards, 'shard')} hard-linked, not copied")
        echo(f"{s.table}: v{s.old} (schema v1) -> v{s.new} (schema v2), {count_text(s.samples, 'sample')}, {how}")
    if dry_run:
        echo("dry run: nothing changed")
        return steps
    for s in steps:
        # Hold the table's rank-0 writer lock: no stage may write this table while it is being migrated.
        lock = fmt.HeldLock(root / s.table / ".write-r00.lock", holder=f"table '{s.table}'")
        try:
            _migrate_table(st, s)
        finally:
            lock.release()
        echo(f"{s.table}: now at v{s.new}")
    return steps


def _migrate_table(st: Store, s: Step) -> None:
    table_dir = st.root / s.table
    for leftover in table_dir.glob(f"v*{MIGRATING_SUFFIX}"):
        shutil.rmtree(leftover)
    new_dir = st.version_dir(s.table, s.new)
    if not s.reuse:
        _build(st.version_dir(s.table, s.old), new_dir, s.old)
    problems = verify_version(new_dir, f"{s.table}/v{s.new}")
    if problems:
        raise UserError(f"migrated {s.table}/v{s.new} failed verification ({problems[0]}); store.json still "
                        f"names v{s.old}. Run `pipeline store verify {st.root}`")
    fmt.crash_point("migrate_before_switch")
    st.set_current(s.table, s.new)
    fmt.crash_point("migrate_after_switch")


def _build(old_dir: Path, new_dir: Path, old_version: int) -> None:
    tmp = new_dir.with_name(new_dir.name + MIGRATING_SUFFIX)
    tmp.mkdir()
    manifest = checked_manifest(old_dir)
    for shard in sorted(set(manifest.column("shard").to_pylist())):
        fmt.link_or_copy(old_dir / shard, tmp / shard)
    fmt.crash_point("migrate_after_links")
    schema = checked_schema(old_dir)  # the new version's checksums.json vouches for what is copied from it
    fields = list(schema.fields)
    if not any(f.name == "img_shapes" for f in fields):
        fields.append(FieldSpec("img_shapes", "json", kind="column"))
    new_schema = type(schema)(schema.name, tuple(fields), schema.lineage, SCHEMA_V2,
                              {**schema.attrs, "migrated_from": old_version})
    fmt.atomic_write_json(tmp / fmt.SCHEMA_JSON, new_schema.to_dict())
    cols = {c: manifest.column(c).to_pylist() for c in ("height", "width", "control_height", "control_width")
            if c in manifest.column_names}
    shapes = [[list(x) for x in img_shapes_from_v1({c: v[i] for c, v in cols.items()})] for i in range(manifest.num_rows)]
    manifest = manifest.append_column("img_shapes", pa.array(shapes, pa.list_(pa.list_(pa.int64()))))
    manifest_bytes = fmt.parquet_bytes(manifest)
    write_version_checksums(tmp, manifest, manifest_bytes, counts=counted(manifest))  # what inspect shows
    fmt.atomic_write_bytes(tmp / fmt.MANIFEST, manifest_bytes)
    fmt.crash_point("migrate_before_rename")
    os.rename(tmp, new_dir)  # the complete version appears at once
    atomic_write.fsync_dir(new_dir.parent)
    fmt.crash_point("migrate_after_rename")
