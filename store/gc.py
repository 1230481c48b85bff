"""`pipeline store gc STORE [--dry-run]`: remove the table versions nothing current references.

Kept: each table's current version (store.json), each complete version past it that was never current (a commit
writes the manifest, then switches store.json: killed in between, or that switch failing, its version is complete
and not current, and its rerun makes it current, `find_version`, instead of writing it again) and, transitively,
the versions named in a kept version's lineage `upstream` (evaluate reads the `images` version its `vae` table was
built from). Removed: every other complete version - replaced by a newer current one, or switched away from to an
older one (store.json's `was_current`, `fmt.table_entry`) - and incomplete versions whose table has no live writer
(a writer holds `.write-rNN.lock`); while a table has a live writer, its versions past the current one are kept.
Carried-forward samples live in hard links inside the version that uses them, so removing an older version
never takes bytes a kept version needs. Kept as well: every version a live read lease names (a training or an
encode stage still reading a version that is no longer current, `store/lease.py`), with its upstream; the files
of dead leases (their process is gone) are removed, first (`lease.remove_dead`: one refreshed since it was
judged is kept, and gc plans again). The rule is `keep_rule`'s, which push applies too (`not_kept`:
what gc would remove is never uploaded).

Removed as well: the shard files of a kept complete version that its checksums.json does not list - tars a
killed writer named but never indexed, which a resumed writer leaves in place (it cannot tell them from shards
whose index its view of a shared folder does not show yet: store/writer_open.py `clean_temp_files`). A complete
version never changes, so a file it does not list is none of its data. And each damaged version a repair set aside
(`v<N>.damaged/`, store/repair.py `set_aside`), named with the bytes it frees (its shards hard-linked into the
repaired version free none), with its damage record `v<N>.damaged.json` once no `v<N>` is left for it to describe
(gc at a URL removes a retired version at once alike, store/remote_gc.py); kept while a live lease names `v<N>`,
as a version is (set_aside moves none that a lease names, so none is expected).

And each `.trim-v<N>/` working folder a killed `store repair` left (store/repair.py `_carry_trimmed`: the shards it
carries as their recorded bytes), named with the bytes it frees - unless a writer of that table is live (a repair
writing it holds the table's writer lock; a repair starting meanwhile waits for the store lock gc holds).

Records beside no version and no set-aside folder (`v<N>.damaged.json`, `.unchanged.json`, notes) are removed too:
a gc killed after a folder's removal and before its records' leaves them (`_stale_records`).

Kill-safe: under the store lock (no version can become current meanwhile) each doomed folder is first renamed
to `.<name>.gc-deleting` (atomic; not a version name, so readers, `verify` and `inspect` no longer see it),
then deleted. A kill leaves either the version intact or a dot-folder that the next `gc` finishes removing.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from schemas import atomic_write
from schemas.errors import UserError
from schemas.newer import WrittenByNewer
from schemas.units import size_text
from store import format as fmt
from store import integrity
from store import lease as leases
from store.manifest_files import checked_schema
from store.version_notes import notes_of

DELETING_SUFFIX = ".gc-deleting"


@dataclass
class GcPlan:
    keep: list[tuple[str, int]] = field(default_factory=list)
    remove: list[Path] = field(default_factory=list)  # version folders, then leftovers of a killed gc
    leftovers: list[Path] = field(default_factory=list)
    unreferenced: list[Path] = field(default_factory=list)  # shard files no complete version lists (kept versions')
    nbytes: int = 0  # bytes freed (files whose last link goes)
    leased: dict[tuple[str, int], list[str]] = field(default_factory=dict)  # kept only for live leases: by whom
    dead_leases: list[leases.Found] = field(default_factory=list)  # lease files of gone processes (removed)
    # kept versions whose schema.json does not read -> why: every version of the other tables kept for them
    unknown_upstream: dict[tuple[str, int], str] = field(default_factory=dict)
    set_aside: list[Path] = field(default_factory=list)  # `v<N>.damaged/` folders repair set aside (removed)
    set_aside_held: dict[Path, list[str]] = field(default_factory=dict)  # ...kept for a live lease on v<N>: by whom
    freed: dict[Path, int] = field(default_factory=dict)  # bytes each removed set-aside folder frees
    # records beside no version and no set-aside folder (`v<N>.damaged.json`, `.unchanged`, notes): a gc killed
    # between a folder's removal and its records' (removed last)
    stale_records: list[Path] = field(default_factory=list)
    # `.trim-v<N>/` working folders of killed `store repair`s (none while a writer of the table is live), removed
    repair_work: list[Path] = field(default_factory=list)
    # complete versions past their table's current one and never current (kept) -> the current version (0: none):
    # a commit whose store.json switch failed; its rerun makes that version current (`find_version`)
    unswitched: dict[tuple[str, int], int] = field(default_factory=dict)


def _every_version(root: Path) -> list[tuple[str, int]]:
    """(table, version) of every version folder in the store at `root`, complete or not."""
    return [(t, u) for t in _tables(root) for u in fmt.list_versions(root, t)]


def _upstream_reader(root: Path) -> Callable[[str, int], list[tuple[str, int]] | None]:
    """The versions a version of the store at `root` names as upstream, each version's schema.json read (and
    checked against its checksums.json, megabytes at 1M samples) once: a plan asks again for each live lease (a
    reader per rank, 64 on 8 nodes) naming the same versions."""
    @functools.lru_cache(maxsize=None)
    def upstream_of(table: str, v: int) -> list[tuple[str, int]] | None:
        vdir = fmt.version_dir(root, table, v)
        if not (vdir / fmt.SCHEMA_JSON).is_file() and not fmt.is_complete(vdir):
            return None
        upstream = checked_schema(vdir, record=False).lineage.upstream
        return [(t, int(u)) for t, u in upstream.items() if fmt.version_dir(root, t, int(u)).is_dir()]

    return upstream_of


def kept_closure(current: dict[str, int] | list[tuple[str, int]],
                 upstream_of: Callable[[str, int], list[tuple[str, int]] | None],
                 every: list[tuple[str, int]], unknown: dict[tuple[str, int], str] | None = None
                 ) -> set[tuple[str, int]]:
    """`current` and the versions they were made from (their lineage's upstream, transitively), for a local store
    and one at a URL (store/remote_gc.py) alike. `upstream_of(table, v)`: those a version names (None: no schema
    yet, an incomplete version), its schema.json checked against its checksums.json (a flipped bit in an upstream
    version number would let gc remove the version it names); UserError when it does not read. Such a version
    names none that can be trusted: then every version (`every`) of every other table is kept (`unknown`: that
    version -> why), where stopping there removed what it may have been built from."""
    keep: set[tuple[str, int]] = set()
    todo = list(current.items()) if isinstance(current, dict) else list(current)
    while todo:
        table, v = todo.pop()
        if (table, v) in keep:
            continue
        keep.add((table, v))
        try:
            upstream = upstream_of(table, v)
        except WrittenByNewer:
            raise
        except UserError as e:
            others = [(t, u) for t, u in every if t != table]
            if unknown is not None and others:  # (a store of that table alone: nothing kept for it to say)
                unknown[(table, v)] = str(e)
            todo += others
            continue
        todo += upstream or []
    return keep


def unswitched(tables: dict[str, dict], versions: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """Of the complete `versions` (local or at a URL), each past its table's current one that was never current
    (not in store.json's `was_current` for it: `tables`, the record's entries) -> that current version (0: none).
    A commit writes its manifest, then switches store.json (store/writer_commit.py, store/remote_parts.py): killed
    in between, or that switch failing, its version is complete and not current, and its rerun makes it current
    instead of writing it all again. A version switched away from to an older one is garbage, as one a newer
    current version replaced."""
    found = {}
    for table, v in versions:
        entry = tables.get(table)
        now = 0 if entry is None else int(entry["current"])
        if v > now and v not in fmt.was_current(entry):
            found[(table, v)] = now
    return found


def _complete_versions(root: Path, every: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Of `every` version of the store at `root` (`_every_version`), the complete ones."""
    return [(t, v) for t, v in every if fmt.is_complete(fmt.version_dir(root, t, v))]


def all_current(entries: dict[str, dict], complete: list[tuple[str, int]] | set[tuple[str, int]]) -> bool:
    """Is each of the `complete` versions (local or at a URL) its table's current one in store.json's `entries`?
    The usual store: then gc removes none of them, and `not_kept` (here and store/remote_gc.py) reads nothing
    more - one test for both, as their answers must agree."""
    return all(t in entries and v == int(entries[t]["current"]) for t, v in complete)


def not_kept(root: Path, entries: dict[str, dict] | None = None, found: list[leases.Found] | None = None
             ) -> tuple[set[tuple[str, int]], list[leases.Found]]:
    """(the complete versions of the store at `root` that gc would remove, its live damaged leases). Removed
    (`keep_rule`, as `plan` keeps): replaced by a newer current one or switched away from (`was_current`), read under
    no live lease, and made nothing kept. Push sends none of them (store/remote_push.py): the URL's gc would remove
    them, and one is tens of GB at 1M samples. `entries`: its store.json's tables, `found`: its leases
    (`leases.leases`), when the caller read them already. While a live lease is damaged (it may name any version:
    store/lease.py `live_versions`) no version is told removed (an empty set) and those leases are returned for the
    caller to name in its own words (`leases.warn_damaged`); `store gc` stops instead (`Found.versions`)."""
    entries = fmt.read_store_record(root)["tables"] if entries is None else entries
    every = _every_version(root)
    complete = _complete_versions(root, every)
    if all_current(entries, complete):  # the usual store: no read
        return set(), []
    found = leases.leases(root) if found is None else found
    damaged = leases.live_versions(found)[1]
    if damaged:  # which versions it keeps cannot be told; leaving garbage out is optional: keep every one
        return set(), damaged
    return set(complete) - keep_rule(root, entries, GcPlan(), every, complete, found)[0], []


def unswitched_lines(found: dict[tuple[str, int], int]) -> list[str]:
    """The line for each complete version kept past its table's current one (local and URL gc alike)."""
    return [f"keep {table}/v{v}: complete, never current (past the current " + (f"v{now}" if now else "none")
            + "): its commit did not switch store.json, and the next run of its settings makes it current; removed"
            " once a newer one is current" for (table, v), now in sorted(found.items())]


def unknown_lines(unknown: dict[tuple[str, int], str]) -> list[str]:
    """What gc says of the versions `kept_closure` kept every other table's versions for."""
    return [f"keep every version of the other tables: {table} v{v} is kept and the versions it was made from are "
            f"unknown: {why}" for (table, v), why in sorted(unknown.items())]


def _tables(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _writer_active(table_dir: Path) -> bool:
    """True when some process holds a writer lock of this table (it may be filling an incomplete version)."""
    return any(fmt.lock_holder(lock) is not None for lock in table_dir.glob(".write-r*.lock"))


def _freed(folder: Path) -> int:
    return sum(_freed_file(p) for p in folder.rglob("*"))


def _freed_file(p: Path) -> int:
    return p.stat().st_size if p.is_file() and p.stat().st_nlink == 1 else 0


def _unreferenced(vdir: Path) -> list[Path]:
    """The shard files (tars, indexes) of complete `vdir` that its checksums.json does not list; none where the
    record is missing (format 1) or damaged (`store repair`'s business: what it lists is then unknown)."""
    try:
        sums = integrity.read_version_checksums(vdir)
    except UserError:
        return []
    if sums is None:
        return []
    return sorted(p for p in vdir.iterdir() if fmt.shard_of(p.name) is not None and p.name not in sums and p.is_file())


_RECORD_RE = re.compile(r"v(\d+)\.(?:damaged|unchanged|note-.+)\.json")


def _stale_records(root: Path, table_dir: Path) -> list[Path]:
    """The records of a version number with neither a version folder nor a set-aside one: left by a gc killed
    after removing the folder. Kept, a repair's working copy took a damage record for a version the repair
    replaced (store/remote_work.py `replaced_here`: to retire at the URL), and a version reusing the number was
    born with its record."""
    table = table_dir.name
    found = [(p, int(m.group(1))) for p in sorted(table_dir.iterdir())
             if p.is_file() and (m := _RECORD_RE.fullmatch(p.name))]
    return [p for p, v in found if not fmt.version_dir(root, table, v).exists()
            and not (table_dir / f"v{v}{fmt.SET_ASIDE_SUFFIX}").exists()]


def keep_rule(root: Path, entries: dict[str, dict], out: GcPlan, every: list[tuple[str, int]],
              complete: list[tuple[str, int]], found_leases: list[leases.Found]
              ) -> tuple[set[tuple[str, int]], dict[tuple[str, int], list[str]]]:
    """What gc keeps of the store at `root` (`entries`: its store.json's tables), once for `plan` and push
    (`not_kept`): each table's current version, its complete versions past it never current (`unswitched`), every
    version a live read lease names, and what these were made from (`kept_closure`). Fills `out`'s unswitched,
    unknown_upstream, leased and dead_leases; returns the kept versions and, per version a live lease names (there
    or not), by whom. `every`: `_every_version(root)` (listed once, not again for each live lease); `complete`:
    `_complete_versions(root, every)` (a stat of each manifest, made once by the caller that needs them too);
    `found_leases`: `leases.leases(root)`. A live damaged lease stops it (`Found.versions`)."""
    current = {t: int(e["current"]) for t, e in entries.items()}
    out.unswitched = unswitched(entries, complete)
    upstream_of = _upstream_reader(root)
    keep = kept_closure(sorted(current.items()) + sorted(out.unswitched), upstream_of, every, out.unknown_upstream)
    named_by: dict[tuple[str, int], list[str]] = {}  # every version a live lease names, existing or not
    for found in found_leases:
        if not found.live:
            out.dead_leases.append(found)
            continue
        for tv in found.versions():
            named_by.setdefault(tv, []).append(found.describe())
        named = [(t, v) for t, v in found.versions() if fmt.version_dir(root, t, v).is_dir()]
        for tv in sorted(kept_closure(named, upstream_of, every, out.unknown_upstream) - keep):
            out.leased.setdefault(tv, []).append(found.describe())
    return keep | set(out.leased), named_by


def plan(root: Path, found: list[leases.Found] | None = None) -> GcPlan:
    """What gc removes and keeps; `found`: the store's leases as judged (`leases.leases`), when read already."""
    entries = fmt.read_store_record(root)["tables"]
    current = {t: int(e["current"]) for t, e in entries.items()}
    out = GcPlan()
    every = _every_version(root)
    keep, named_by = keep_rule(root, entries, out, every, _complete_versions(root, every),
                               leases.leases(root) if found is None else found)
    out.keep = sorted(keep)
    for table_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        out.leftovers += sorted(p for p in table_dir.iterdir() if p.name.endswith(DELETING_SUFFIX))
        active = _writer_active(table_dir)
        newest_current = current.get(table_dir.name, 0)
        for v in fmt.list_versions(root, table_dir.name):
            vdir = fmt.version_dir(root, table_dir.name, v)
            # A live writer's version: still being filled, or complete (its manifest written) and about to become
            # current (store.json is switched next, store/writer_commit.py). Writers only ever create versions
            # past the newest, so with a writer live every version past the current one is kept.
            if (table_dir.name, v) in keep or (active and (not fmt.is_complete(vdir) or v > newest_current)):
                if fmt.is_complete(vdir):
                    out.unreferenced += _unreferenced(vdir)
                continue
            out.remove.append(vdir)
        out.stale_records += _stale_records(root, table_dir)
        if not active:  # a live repair writes its folder while it holds the table's writer lock
            for d in sorted(p for p in table_dir.iterdir() if p.is_dir() and fmt.TRIM_RE.fullmatch(p.name)):
                out.repair_work.append(d)
                out.freed[d] = _freed(d)
        for v, aside in fmt.set_aside_versions(root, table_dir.name):
            if (table_dir.name, v) in named_by:
                out.set_aside_held[aside] = named_by[(table_dir.name, v)]
            else:
                out.set_aside.append(aside)
                out.freed[aside] = _freed(aside)
    out.nbytes = (sum(_freed(p) for p in out.remove + out.leftovers) + sum(out.freed.values())
                  + sum(_freed_file(p) for p in out.unreferenced))
    return out


def collect(root: Path, dry_run: bool = False, echo: Callable[[str], None] = print) -> GcPlan:
    root = Path(root)
    # a dry run changes nothing, so it needs no store lock (which a read-only store cannot create)
    with (nullcontext() if dry_run else fmt.flock(root / fmt.STORE_LOCK, changes_store=True)):
        found = leases.leases(root)
        p = plan(root, found)
        if not dry_run and p.dead_leases:
            p = _dead_leases_removed(root, p, found)
        _say_plan(root, p, dry_run, echo)
        if dry_run:
            echo(f"dry run: {len(p.remove)} version(s){_files_note(p)}, {size_text(p.nbytes)} would be freed")
            return p
        _remove(root, p)
        echo(f"gc: removed {len(p.remove)} version(s){_files_note(p)}, freed {size_text(p.nbytes)}; kept "
             + ", ".join(f"{t} v{v}" for t, v in p.keep))
    return p


def _say_plan(root: Path, p: GcPlan, dry_run: bool, echo: Callable[[str], None]) -> None:
    """A line for everything the plan removes or keeps for a reader, before anything is removed."""
    remove = "would remove" if dry_run else "remove"
    for vdir in p.remove:
        echo(f"{remove} {vdir.relative_to(root)}")
    for d in p.leftovers:
        echo(f"{'would finish removing' if dry_run else 'finish removing'} {d.relative_to(root)} (an interrupted gc)")
    for f in p.unreferenced:
        echo(f"{remove} {f.relative_to(root)} (no file of its version: a shard its writer was killed before "
             "indexing)")
    for d in p.set_aside:
        echo(f"{remove} {d.relative_to(root)} (a damaged version a repair set aside; {size_text(p.freed[d])}"
             f"{' would be' if dry_run else ''} freed)")
    for d in p.repair_work:
        echo(f"{remove} {d.relative_to(root)} (the working folder of a store repair that was killed; "
             f"{size_text(p.freed[d])}{' would be' if dry_run else ''} freed)")
    for d, by in sorted(p.set_aside_held.items()):
        echo(f"keep {d.relative_to(root)}: a damaged version set aside, but its number is read by " + "; ".join(by))
    for (table, v), by in sorted(p.leased.items()):
        echo(f"keep {table}/v{v}: not current, but read by " + "; ".join(by))
    for line in unswitched_lines(p.unswitched):
        echo(line)
    for f in p.stale_records:
        echo(f"{remove} {f.relative_to(root)} (the record of a version no longer there: an interrupted gc)")
    for found in p.dead_leases:
        echo(f"{remove} the lease of a gone reader: {found.describe()}")
    for line in unknown_lines(p.unknown_upstream):
        echo(line)


def _remove(root: Path, p: GcPlan) -> None:
    """The plan carried out: each folder renamed out of the store first (the commit), then deleted; records last."""
    _forget_removed(root, p)
    doomed = list(p.leftovers)
    for vdir in p.remove + p.set_aside + p.repair_work:
        fmt.crash_point("gc_before_rename")
        gone = vdir.with_name(f".{vdir.name}{DELETING_SUFFIX}")
        shutil.rmtree(gone, ignore_errors=True)
        os.rename(vdir, gone)  # the commit: from here on it is no version
        atomic_write.fsync_dir(vdir.parent)
        doomed.append(gone)
        fmt.crash_point("gc_after_rename")
    for d in doomed:
        for f in sorted(d.rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() and not f.is_symlink() else f.unlink()
            fmt.crash_point("gc_mid_delete")
        d.rmdir()
    for f in p.unreferenced:
        f.unlink(missing_ok=True)
    for vdir in p.remove:  # `store repair`'s marker (and the fixes' record) of a removed version name nothing now
        _remove_records(root, vdir.parent.name, int(vdir.name.lstrip("v")))
    for aside in p.set_aside:  # its damage record too, unless a version of that number (reused) has it now
        table, v = aside.parent.name, int(fmt.SET_ASIDE_RE.fullmatch(aside.name).group(1))
        if not fmt.version_dir(root, table, v).exists():
            _remove_records(root, table, v)
    for f in p.stale_records:  # after the folders: a kill before leaves them for the next gc
        f.unlink(missing_ok=True)


def _dead_leases_removed(root: Path, p: GcPlan, found: list[leases.Found]) -> GcPlan:
    """The files of the dead leases among `found` (what `p` was planned with) removed before anything else
    (`leases.remove_dead`), and `p` planned again when one was refreshed since it was judged: kept, with what it
    names. (Removed after the versions it named, such a lease - its reader refreshing it by its own clock, a gc
    judging it stale by another's - was removed all the same, and its reader stopped.)"""
    final = leases.remove_dead(root, found)
    if [f for f in final if f.live] == [f for f in found if f.live]:
        return p
    return plan(root, final)


def _forget_removed(root: Path, p: GcPlan) -> None:
    """Before any folder goes: the numbers of the versions removed (and of none there, removed by hand) leave
    store.json's `was_current`, as a later version of that number is another one, never current. A kill after
    this leaves such a version taken for never current: kept by the next gc until a newer one is current."""
    rec = fmt.read_store_record(root)
    if not any(fmt.was_current(e) for e in rec["tables"].values()):  # the usual store: no listing
        return
    removed = {(vdir.parent.name, int(vdir.name.lstrip("v"))) for vdir in p.remove}
    there = {t: set(fmt.list_versions(root, t)) for t in rec["tables"]}
    tables = fmt.forget_was_current(rec["tables"], lambda t, v: (t, v) in removed or v not in there[t])
    if tables is not None:
        from store.io_errors import writing

        with writing("store.json", root):
            fmt.write_store_record(root, {**rec, "tables": tables})


def _remove_records(root: Path, table: str, v: int) -> None:
    fmt.damaged_marker(root, table, v).unlink(missing_ok=True)
    fmt.unchanged_marker(root, table, v).unlink(missing_ok=True)
    for note in notes_of(root, table, v):
        note.unlink(missing_ok=True)


def _files_note(p: GcPlan) -> str:
    return ((f", {len(p.set_aside)} damaged version(s) set aside" if p.set_aside else "")
            + (f", {len(p.repair_work)} killed repair's working folder(s)" if p.repair_work else "")
            + (f" and {len(p.unreferenced)} unreferenced shard file(s)" if p.unreferenced else ""))
