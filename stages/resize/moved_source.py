"""A source read before at another path: the same dataset moved, renamed or mounted elsewhere (/data/x -> /mnt/x).

The lineage names a local source by its content (content.py: each file's path relative to the source and the
sha256 of its bytes), so a complete version stays up to date wherever those files now lie. Two things also record
where they were read: the version's `attrs.source` (part of the exact schema a resumed writer must match) and
each row's `source` name (the file under that path).

- Up to date: the complete version is reused as it is. It is immutable (checksums.json covers its schema and
  manifest), so it keeps naming where it was read; the summary says where that was and where the source is now.
- Resume: a killed run's in-progress version whose schema differs only in `attrs.source` is adopted
  (`adopt_in_progress`): under the table's writer lock its committed shards' indexes get their `source` names
  moved from the old folder to the new one (index files only; no shard is rewritten), then its schema.json
  records the new path. The writer then resumes it, the finished samples are found by their new names without
  being read (resumed_sources.py), and the table names the new path throughout, as an uninterrupted run there
  would. Indexes first, schema last: a kill in between leaves the old schema, so the next run adopts again
  (names already moved stay as they are).

A source at URLs is named by its URLs in the listing hash: at another URL it is another lineage, rendered anew
(its unchanged samples carried forward). A `::` list of shards is named as given (not resolved): not adopted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from schemas import TableSchema, UserError, atomic_write
from stages.resize.content import listing_base
from stages.resize.shards import is_shard_list
from stages.resize.sources import printable
from store.remote import is_url

if TYPE_CHECKING:
    from store import Store

TABLE = "images"


@dataclass(frozen=True)
class Moved:
    """An in-progress version begun from `before`, which holds the same content as the source now."""

    version: int
    before: str


def recorded_source(st: Store, version: int) -> str:
    """Where `version` recorded reading its source ("" when it did not): for the summary only, of a version
    `find_version` has just read checked."""
    from store.manifest_files import read_schema

    return str(read_schema(st.version_dir(TABLE, version)).attrs.get("source") or "")


def _local(source: str) -> bool:
    return bool(source) and not is_url(source) and "::" not in source


def in_progress_elsewhere(st: Store, schema: TableSchema) -> Moved | None:
    """The newest in-progress version whose schema is `schema` but for `attrs.source` (a local path), when none
    has exactly `schema` (that one the writer resumes as it is)."""
    from store import format as fmt
    from store.writer_open import candidate_version

    want = schema.to_dict()
    now = want["attrs"].get("source", "")
    if not _local(now):
        return None
    versions = fmt.list_versions(st.root, TABLE)
    if candidate_version(st.root, TABLE, want) in versions:
        return None
    for v in reversed(versions):
        before = _before(st.version_dir(TABLE, v), want)
        if before is not None:
            return Moved(v, before)
    return None


def _before(vdir: Path, want: dict[str, Any]) -> str | None:
    """The source `vdir` was begun from, when it is in progress and its schema is `want` but for that path."""
    from store import format as fmt

    if fmt.is_complete(vdir) or not (vdir / fmt.SCHEMA_JSON).is_file():
        return None
    try:
        raw = fmt.read_json(vdir / fmt.SCHEMA_JSON, "schema.json")
    except UserError:
        return None
    attrs = raw.get("attrs") if isinstance(raw, dict) else None
    before = attrs.get("source") if isinstance(attrs, dict) else None
    if not isinstance(before, str) or not _local(before) or before == want["attrs"]["source"]:
        return None
    return before if {**raw, "attrs": {**attrs, "source": want["attrs"]["source"]}} == want else None


MOVING = ".source-moved.json"  # an adoption's second phase is due: {"to": the path its schema will record}
# suffix of an index's renamed copy, put in place in the second phase. A temp file's name (`fmt.is_litter`): the
# copies of a first phase cut short, and not redone (the source moved back), are removed as litter by the writer
# that resumes the version and by its commit, never listed in its checksums.json
MOVED = ".tmp-moved"


def adopt_in_progress(st: Store, moved: Moved, schema: TableSchema) -> int | None:
    """Make `moved.version` the in-progress version of `schema` (its source now where `schema` says): its rows'
    source names moved, then its schema.json rewritten. Returns how many committed samples it holds (None, nothing
    done: a writer finished or adopted it meanwhile, or its rows are not named under the old path).

    In two phases, so that a kill anywhere leaves every name either as read or moved, never moved twice: each
    index's renamed copy beside it, then the `MOVING` mark; then each copy over its index and the schema, and the
    mark goes. A run meeting the mark finishes the second phase (`finish_moves`); without it the copies are
    made again from the untouched indexes."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    from store import format as fmt
    from store.io_errors import writing
    from store.writer_open import index_paths, lock_rank

    want = schema.to_dict()
    lock = lock_rank(st.root, TABLE, 0)  # the images writer's: no writer fills the version while it is renamed
    try:
        vdir = st.version_dir(TABLE, moved.version)
        if _before(vdir, want) != moved.before or (vdir / MOVING).exists():
            return None
        held = 0
        with writing(f"table '{TABLE}' v{moved.version}", vdir):
            for p in vdir.glob(f".*{MOVED}"):  # a first phase cut short: made again
                p.unlink()
            indexes = index_paths(vdir)
            rename = _renamer(moved.before, str(listing_base(want["attrs"]["source"])), indexes)
            if rename is None:
                return None
            # one index per shard, each rewritten and synced: thousands of them for a million samples
            for p in tqdm(indexes, desc=f"source moved: renaming in the shard indexes of v{moved.version}",
                          unit="index", leave=False):
                index = pq.read_table(p)
                i = index.schema.get_field_index("source")
                names = index.column(i).to_pylist()
                held += len(names)
                field = index.schema.field(i)
                renamed = index.set_column(i, field, pa.array([rename(n) for n in names], field.type))
                fmt.atomic_write_parquet(_copy_of(p), renamed)
            fmt.atomic_write_json(vdir / MOVING, {"to": want["attrs"]["source"]})
            fmt.crash_point("moved_source_marked")
            _second_phase(vdir)
        return held
    finally:
        lock.release()


def finish_moves(st: Store) -> None:
    """Finish an adoption killed in its second phase (before any writer opens the version, whatever the source
    path now: its schema, still the old one, would otherwise be resumed with half its names moved)."""
    from store import format as fmt
    from store.io_errors import writing
    from store.writer_open import lock_rank

    pending = [v for v in fmt.list_versions(st.root, TABLE) if (st.version_dir(TABLE, v) / MOVING).is_file()]
    if not pending:
        return
    lock = lock_rank(st.root, TABLE, 0)
    try:
        for v in pending:
            vdir = st.version_dir(TABLE, v)
            if (vdir / MOVING).is_file():
                with writing(f"table '{TABLE}' v{v}", vdir):
                    _second_phase(vdir)
    finally:
        lock.release()


def _copy_of(index: Path) -> Path:
    return index.with_name(f".{index.name}{MOVED}")


def _second_phase(vdir: Path) -> None:
    """Every renamed copy over its index, the source the mark names into schema.json, the mark removed."""
    from store import format as fmt

    to = fmt.read_json(vdir / MOVING, MOVING)["to"]
    for copy in sorted(vdir.glob(f".*{MOVED}")):
        os.replace(copy, copy.with_name(copy.name[1:-len(MOVED)]))
    atomic_write.fsync_dir(vdir)
    raw = fmt.read_json(vdir / fmt.SCHEMA_JSON, "schema.json")
    fmt.atomic_write_json(vdir / fmt.SCHEMA_JSON, {**raw, "attrs": {**raw["attrs"], "source": to}})
    (vdir / MOVING).unlink()
    atomic_write.fsync_dir(vdir)


def _renamer(before: str, base_now: str, indexes: list[Path]) -> Callable[[str | None], str | None] | None:
    """A row's source name read under `before` -> the same file's name under `base_now` (the new listing base).
    A folder source's rows lie under it, a file's (`<file>:<n>`) or a brace list's under its folder
    (content.listing_base): the rows say which, so the old path need not exist any more. None when the first
    row lies under neither (not this stage's naming): such a version is not adopted."""
    import pyarrow.parquet as pq

    first = next((n for p in indexes for n in pq.read_table(p, columns=["source"]).column(0).to_pylist()[:1]), None)
    old, parent = printable(before).rstrip(os.sep), printable(str(Path(before).parent)).rstrip(os.sep)
    if first is None or first.startswith(old + os.sep):
        base = old
    elif first.startswith(parent + os.sep) and (first.startswith(old + ":") or is_shard_list(before)):
        base = parent
    else:
        return None
    now = printable(base_now).rstrip(os.sep)

    def rename(name: str | None) -> str | None:
        if name is not None and name.startswith(base + os.sep):
            return now + name[len(base):]
        return name  # not under the old source (no row this stage writes): left as recorded

    return rename
