"""What resize-bucket finds of the `images` versions before this run: a complete one of this lineage (up to date,
also one made before this revision's fixes that they leave unchanged, or one opened from a store URL), an
in-progress one begun from the same content elsewhere (adopted), a damaged current one (repaired), the line saying
why a new version is made, and the samples rendered before with the same pixel settings (carried forward)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from schemas import TableSchema, UserError
from schemas.up_to_date import is_current
from stages.resize.images_table import (STAGE, TABLE, TRANSPARENCY_NOTED, fixed_since, lineages_before_fixes,
                                        pictures_before_fixes, pictures_other_alpha, told_by_source_since)
from stages.resize.moved_source import Moved

if TYPE_CHECKING:
    from store import Store


def adopted(st: Store, schema: TableSchema) -> Moved | None:
    """The in-progress version a killed run began from the same content at another path, adopted: the writer
    resumes it (moved_source.py). An adoption killed half-way is finished first, whatever the path now."""
    from stages.resize.moved_source import adopt_in_progress, finish_moves, in_progress_elsewhere

    finish_moves(st)
    moved = in_progress_elsewhere(st, schema)
    return moved if moved is not None and adopt_in_progress(st, moved, schema) is not None else None


def up_to_date_version(st: Store, schema: TableSchema) -> tuple[int | None, int | None]:
    """A complete version with this lineage (same source listing and settings), made current again - on the store
    URL too when `st` is its cache - and the higher version another writer made current there meanwhile (None: none),
    which stays current."""
    from store import repair_context
    from store.remote_parts import adopt_version

    repair_context.check(schema.lineage, TABLE)
    found = _complete_version(st, schema)
    if found is None and _opened_from_remote(st, schema):
        found = _complete_version(st, schema)
    if found is None:
        return None, None
    return found, adopt_version(st, TABLE, found)  # e.g. killed after the manifest, before the store.json switch


def _complete_version(st: Store, schema: TableSchema) -> int | None:
    from store import repair_context

    found = st.find_version(TABLE, schema.lineage)
    if found is None and not repair_context.active():
        found = _unchanged_by_fixes(st, schema)
    return found


def _opened_from_remote(st: Store, schema: TableSchema) -> bool:
    """A store URL's cache holds the remote's current version only (a new machine, an emptied cache): an older
    complete version of these settings on the remote (settings A -> v1, B -> v2, then A again) is opened in it
    lazily, for `_complete_version` to judge as it judges a local one; before, every image was rendered again
    into v3 (hours at 1M images). Its lineage is this run's, or the one before this revision's fixes. Not under
    `store repair`: its working copy holds every version it may reuse, and one it replaced awaits its retirement
    on the remote. One process decides (resize-bucket runs on rank 0 alone under a launcher: `main_alone`)."""
    from store import repair_context
    from store.remote_parts import open_committed

    if repair_context.active():
        return False
    wanted = [schema.lineage.to_dict(), *(old.to_dict() for _, old in lineages_before_fixes(schema.lineage))]

    def same(recorded: Any) -> bool:  # compared as `Store.find_version` compares a local version's schema.json
        try:
            lineage = TableSchema.from_dict(recorded).lineage.to_dict()
        except (UserError, KeyError, TypeError, AttributeError):
            return False
        return any(is_current(lineage, w) for w in wanted)

    return open_committed(st.root, TABLE, same) is not None


def _unchanged_by_fixes(st: Store, schema: TableSchema) -> int | None:
    """A complete version made before the fixes of this revision (by the newest earlier revision that has one),
    none of whose samples the fixes made since change: still current (its downstream tables too). One with such a
    sample is not: a new version re-renders those."""
    from schemas.lineage import settings_hash
    from store.manifest_files import checked_manifest
    from store.reuse import unchanged_by_fixes

    for revision, before in reversed(lineages_before_fixes(schema.lineage)):
        found = st.find_version(TABLE, before)
        if found is None:
            continue
        fixed = fixed_since(revision)

        def none_changed() -> bool:
            try:
                rows = checked_manifest(st.version_dir(TABLE, found), list(fixed.columns))
            except UserError:
                return False
            return not fixed(rows).any()

        # a yes is recorded with the version: a rerun of an unchanged store reads no rows (store/reuse.py)
        return found if unchanged_by_fixes(st, TABLE, found, settings_hash(schema.lineage.to_dict()), none_changed) \
            else None
    return None


def say_why_new(st: Store, schema: TableSchema, pending: frozenset[str] = frozenset()) -> None:
    """One line: what differs between this run and the newest complete `images` version (its resize settings,
    named; the source's listing; the code revision), as the encoders and train say it (`schemas.up_to_date`).
    Nothing when there is none or nothing differs (a version recorded as damaged: re-rendered, said below).
    With tars or parquet files hashed as they are read (`pending`: first_read.py) the listing hash now is
    provisional, one the version will not have: the line says that instead of printing it."""
    from schemas import up_to_date
    from store import repair_context

    newest = st.newest_complete(TABLE)
    if newest is None or repair_context.active():
        return
    version, before = newest
    from stages.resize.split_rule import ATTR, recorded_rule

    if recorded_rule(before.attrs) != schema.attrs[ATTR]:  # only where resize.split_by sets it (split_rule.py)
        tqdm.write(f"{STAGE}: images v{version} was split by {recorded_rule(before.attrs)}, this run splits by "
                   f"{schema.attrs[ATTR]} (resize.split_by): samples move between 'train' and 'val' in the new "
                   "version (their pictures carried, not rendered again)")
    lineage = schema.lineage
    if pending:
        settings, _, _ = lineage.config_hash.partition("-")
        lineage = replace(lineage, config_hash=f"{settings}-(hashed as its {len(pending)} file(s) new to this store "
                                               "are read)")
    differences = up_to_date.lineage_differences(before.lineage, lineage, {
        "settings": "resize settings", "data": "source listing (its files and their bytes)"})
    if differences and all(d.startswith("source listing") for d in differences) and _left_unread(st, version):
        # its listing names the files a read error kept out: they are what differs, unless other files changed too
        tqdm.write(f"{STAGE}: images v{version} left out the samples of files a read error kept from being read: "
                   "reading those files again, and any file changed since (the rest carried, not re-rendered); no "
                   "new version if they fail again and nothing else changed")
        return
    if isinstance(before.attrs.get("resize"), dict) and differences:
        differences += up_to_date.changed_settings(before.attrs["resize"], schema.attrs["resize"], "resize",
                                                   missing="(default)")
    if differences:
        tqdm.write(up_to_date.new_version_line(STAGE, TABLE, version, differences))


def _left_unread(st: Store, version: int) -> bool:
    """Did a read error keep some files of the source out of `version` (its `.read-errors.json`, first_read.py)?"""
    from stages.resize.first_read import READ_ERRORS_JSON

    return (st.version_dir(TABLE, version) / READ_ERRORS_JSON).is_file()


def damaged_current(st: Store) -> int | None:
    """The current version when it is recorded as damaged (find_version skipped it): this run re-renders its
    damaged samples. Not under `store repair`, which verifies and sets aside itself."""
    from store import format as fmt_
    from store import repair_context

    current = st.tables().get(TABLE)
    if current is None or repair_context.active() or not fmt_.damaged_marker(st.root, TABLE, current).exists():
        return None
    return current


def reusable_renders(st: Store, schema: TableSchema, now: tuple[str, ...]) -> tuple[dict[str, str], set[str]]:
    """key -> mask hash of every sample an earlier version rendered with the same pixel settings (`now`:
    `pictures_now`; or with the revision before this one's fixes, when they leave the sample unchanged), and the
    keys among them to carry only once their source pictures' headers say a fix leaves them unchanged
    (`TOLD_BY_SOURCE`)."""
    from store.reuse import reusable_keys

    fixed: dict[str, str] = {}
    checked: set[str] = set()
    for revision, before in pictures_before_fixes(schema):  # oldest first: a later revision's row wins
        keys = reusable_keys(st, TABLE, before, "mask_sha256", changed=fixed_since(revision, by_rows=True))
        fixed.update(keys)
        if told_by_source_since(revision):
            checked.update(keys)
        else:
            checked.difference_update(keys)
    for lineage in pictures_other_alpha(schema):  # rendered under the other keep_alpha: the opaque samples are these
        keys = reusable_keys(st, TABLE, lineage, "mask_sha256", changed=TRANSPARENCY_NOTED)
        fixed.update(keys)
        checked.difference_update(keys)
    same: dict[str, str] = {}
    for lineage in reversed(now):  # this run's own spelling last: its row wins
        same.update(reusable_keys(st, TABLE, lineage, "mask_sha256"))
    checked.difference_update(same)
    return {**fixed, **same}, checked

