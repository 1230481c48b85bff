"""`pipeline store gc URL [--dry-run]`: store/gc.py for a store at a URL.

Kept, as on a local disk: each table's current version (store.json), each complete version past it that was never
current (a commit whose store.json swap failed: its rerun adopts it, store/remote_parts.py `on_remote`; store/gc.py
`unswitched`), the versions a kept version's lineage names (`upstream`), and every version a live lease object
names (store/remote_lease.py: readers and pushes in progress), with their upstream. Removed:
- every other complete version (one with a manifest): replaced by a newer current one, or switched away from to
  an older one (store.json's `was_current`; its number leaves that record first, `_forget_removed`);
- incomplete versions (data objects without a manifest: a push or a gc that was killed half-way) that no live
  lease names and whose newest object is older than `grace_s` (default 1 hour): a version number a killed push
  left behind then no longer blocks another store's push of that number;
- versions `store repair URL` retired (marked damaged, manifest deleted: store/remote_work.py) at once;
- lease objects judged dead, judged again right before their DELETE (`_still_dead`: one live again - a reader woke
  since the plan and refreshed it - is kept, unless it names a version this run removed: its reader must stop, not
  read on from a deleted version), and the damaged marker (`<table>/v<N>.damaged.json`) of a removed version.
- objects inside a kept complete version that its checksums.json does not list, older than `grace_s`: what a
  push that lost the race for that version number wrote there before the winner's commit (`_strays`);
- on S3, unfinished multipart uploads under the prefix (a push killed mid-shard), older than `grace_s` and not in a
  version a live lease names: aborted.

Order, per version: the leases and store.json are read again (one listing, one GET) right before its manifest is
DELETEd, so a lease written or a version made current since the plan still keeps it; the manifest goes first (the
version stops existing at once for every reader: pull, verify and inspect list versions by their manifest), the
leases are listed once more, then the rest of its objects - unless a lease names the version now: a reader that
took its lease between the look and the manifest DELETE passed its manifest check and reads on, so its data stays
(incomplete, removed by a later gc once no lease names it). A killed gc leaves an incomplete version, which the next gc removes after the
grace period. docs/store-format.md, "On an object store", states the remaining race and why it is safe.
"""

from __future__ import annotations

import logging
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from schemas.errors import UserError
from schemas.units import size_text
from store import format as fmt
from store import remote_endpoint, remote_lease
from store.gc import all_current, kept_closure, unknown_lines, unswitched, unswitched_lines
from store.lease import Found, live_versions
from store.manifest_files import checked_schema
from store.remote import CLOCK_DIR, Remote, open_remote, remote_errors
from store.remote_local import UPLOAD_DIR
from store.remote_sync import _parse_record, remote_record, version_files

log = logging.getLogger("store")

GRACE_SECONDS = 3600.0
_OBJECT_RE = re.compile(r"([^./][^/]*)/v(\d+)/(.+)")
_MARKER_RE = re.compile(r"([^./][^/]*)/v(\d+)\.damaged\.json")


@dataclass
class Version:
    table: str
    version: int
    objects: dict[str, tuple[int, float]] = field(default_factory=dict)  # rel: (size, modified)
    leases_seen: dict[str, tuple[int, float]] | None = None  # live leases at the look before its DELETE

    @property
    def name(self) -> str:
        return f"{self.table}/v{self.version}"

    @property
    def complete(self) -> bool:
        return f"{self.name}/{fmt.MANIFEST}" in self.objects

    @property
    def nbytes(self) -> int:
        return sum(n for n, _ in self.objects.values())

    @property
    def newest(self) -> float:
        return max(t for _, t in self.objects.values())


@dataclass
class RemoteGcPlan:
    keep: list[tuple[str, int]] = field(default_factory=list)
    remove: list[Version] = field(default_factory=list)  # complete versions, then incomplete ones
    young_incomplete: list[Version] = field(default_factory=list)  # kept: within the grace period
    leased: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    dead_leases: list[Found] = field(default_factory=list)  # lease objects of gone processes (path: the object)
    markers: dict[tuple[str, int], str] = field(default_factory=dict)  # damaged markers by version
    leftovers: list[str] = field(default_factory=list)  # clock probes and temp uploads of killed commands
    # objects inside a kept complete version that its checksums.json does not list, older than the grace period:
    # a push that lost the race for that version number wrote them before the other's commit (`_strays`)
    strays: list[str] = field(default_factory=list)
    uploads: list[tuple[str, str]] = field(default_factory=list)  # (key, upload id): unfinished multipart uploads
    now: float = 0.0  # the server's clock at the plan
    # kept versions whose schema.json does not read -> why: every version of the other tables kept for them
    unknown_upstream: dict[tuple[str, int], str] = field(default_factory=dict)
    # complete versions past their table's current one and never current -> the current one (0: none), kept
    unswitched: dict[tuple[str, int], int] = field(default_factory=dict)
    was_current: set[tuple[str, int]] = field(default_factory=set)  # store.json's `was_current`, at the plan
    nbytes: int = 0


def _current(remote: Remote) -> dict[str, int] | None:
    """The current versions; None without a store.json (a first push killed before it: nothing is current yet,
    so gc keeps every complete version and removes only stale incomplete ones)."""
    return _currents(_entries(remote))


def _currents(entries: dict[str, dict] | None) -> dict[str, int] | None:
    """Each table's current version of store.json's table entries (None: no store.json)."""
    return None if entries is None else {t: int(e["current"]) for t, e in entries.items()}


def _entries(remote: Remote) -> dict[str, dict[str, Any]] | None:
    """store.json's table entries (`fmt.table_entry`); None without a store.json."""
    record = remote_record(remote, None)
    return None if record is None else record["tables"]


def read_once(remote: Remote) -> Callable[[str], bytes]:
    """`remote.read`, each object fetched once per plan: the closure, each live lease's and the strays' check
    read the same schema.json / checksums.json (a version's checksums.json can be megabytes)."""
    got: dict[str, bytes] = {}

    def read(rel: str) -> bytes:
        if rel not in got:
            got[rel] = remote.read(rel, small=True)
        return got[rel]

    return read


def _closure(remote: Remote, roots: list[tuple[str, int]], versions: dict[tuple[str, int], Version],
             unknown: dict[tuple[str, int], str] | None = None, read: Callable[[str], bytes] | None = None,
             named: dict[tuple[str, int], list[tuple[str, int]] | None] | None = None) -> set:
    """`roots` and, transitively, the versions their schema.json lineage names as upstream: store/gc.py's
    `kept_closure`, each schema.json checked against its version's checksums.json as on a local disk (through a
    temporary copy of the two objects); one that does not read keeps every version of the other tables. `named`:
    what each version names, shared by a plan's calls (one per live lease, a reader per rank: each version's
    checksums.json, megabytes at 1M samples, was parsed again for each)."""
    from store.remote_parts import SOURCE_URL

    named = {} if named is None else named
    with tempfile.TemporaryDirectory(prefix="store-gc-") as tmp:
        # the copy of `remote`'s metadata, as verify's is: damage is advised as at a URL (delete, push again)
        (Path(tmp) / SOURCE_URL).write_text(remote.url)
        def upstream_of(table: str, number: int) -> list[tuple[str, int]] | None:
            if (table, number) not in named:
                named[(table, number)] = read_upstream(table, number)
            return named[(table, number)]

        def read_upstream(table: str, number: int) -> list[tuple[str, int]] | None:
            v = versions.get((table, number))
            if v is None or (not v.complete and f"{v.name}/{fmt.SCHEMA_JSON}" not in v.objects):
                return None  # gone, or an incomplete version without one yet
            vdir = fmt.version_dir(Path(tmp), table, number)
            vdir.mkdir(parents=True, exist_ok=True)
            for name in (fmt.CHECKSUMS, fmt.SCHEMA_JSON):
                if f"{v.name}/{name}" in v.objects:
                    try:
                        (vdir / name).write_bytes((read or remote.read)(f"{v.name}/{name}"))
                    except FileNotFoundError:  # removed meanwhile: read as missing
                        pass
            try:
                upstream = checked_schema(vdir, record=False).lineage.upstream
            except UserError as e:  # named by its URL, not the temporary copy
                raise type(e)(str(e).replace(f", cached in {vdir}", "").replace(str(vdir), f"{remote.url}/{v.name}")) \
                    from None
            return [(t, int(u)) for t, u in upstream.items()]

        return kept_closure(roots, upstream_of, sorted(versions), unknown)


def plan(remote: Remote, grace_s: float = GRACE_SECONDS, now: float | None = None) -> RemoteGcPlan:
    """`now`: the server's clock by default (ages are measured on LastModified, the server's times)."""
    now = remote.now() if now is None else now
    listing = remote.listing_times()
    if not listing:
        raise UserError(remote_endpoint.not_s3(remote.url)
                        or f"no store at {remote.url} (nothing there); check the URL")
    versions = _versions(listing)
    out = RemoteGcPlan()
    for rel, info in listing.items():
        if m := _MARKER_RE.fullmatch(rel):
            out.markers[(m.group(1), int(m.group(2)))] = rel
        elif rel.startswith((CLOCK_DIR + "/", UPLOAD_DIR + "/")) and now - info[1] >= grace_s:
            # a clock probe of a command killed between its PUT and its DELETE, or the temp file of a killed
            # write to a file:// remote (store/remote_local.py); untouched for the grace period: not in use
            out.leftovers.append(rel)
    read = read_once(remote)
    found_leases = remote_lease.leases(remote, listing, now)  # one GET per lease object (a reader per rank)
    keep = keep_rule(remote, versions, _entries(remote), out, read, found_leases)
    held = {tv for found in found_leases if found.live for tv in found.versions()}
    out.uploads = _stale_uploads(remote, now, grace_s, held)
    out.keep = sorted(tv for tv in keep if tv in versions)
    out.strays = _strays(remote, [versions[tv] for tv in out.keep if versions[tv].complete], now, grace_s, read)
    doomed = [v for tv, v in sorted(versions.items()) if tv not in keep]
    out.remove = [v for v in doomed if v.complete]
    for v in (v for v in doomed if not v.complete):
        retired = (v.table, v.version) in out.markers  # repair retired it: no push is writing it
        (out.remove if retired or now - v.newest >= grace_s else out.young_incomplete).append(v)
    out.nbytes = sum(v.nbytes for v in out.remove)
    out.now = now
    return out


def _versions(listing: dict[str, tuple[int, float]]) -> dict[tuple[str, int], Version]:
    """The versions of a listing (complete or not), each with its objects."""
    versions: dict[tuple[str, int], Version] = {}
    for rel, info in listing.items():
        if m := _OBJECT_RE.fullmatch(rel):
            key = (m.group(1), int(m.group(2)))
            versions.setdefault(key, Version(*key)).objects[rel] = info
    return versions


def keep_rule(remote: Remote, versions: dict[tuple[str, int], Version], entries: dict[str, dict] | None,
              out: RemoteGcPlan, read: Callable[[str], bytes], found_leases: list[Found]) -> set[tuple[str, int]]:
    """What gc keeps at the URL (store/gc.py `keep_rule`'s, once for `plan` and pull: `not_kept`): each table's
    current version (every complete one without a store.json), the complete ones past it never current, every
    version a live lease (of `found_leases`: `remote_lease.leases`) names, and what these were made from. Fills
    `out`'s unswitched, was_current, unknown_upstream, leased and dead_leases. A live damaged lease stops it
    (`Found.versions`)."""
    current = _currents(entries)
    roots = sorted(current.items()) if current is not None else [tv for tv, v in versions.items() if v.complete]
    if entries is not None:  # (without a store.json every complete version is a root already)
        out.unswitched = unswitched(entries, [tv for tv, v in sorted(versions.items()) if v.complete])
        out.was_current = {(t, v) for t, e in entries.items() for v in fmt.was_current(e)}
        roots += sorted(out.unswitched)
    named: dict[tuple[str, int], list[tuple[str, int]] | None] = {}
    keep = _closure(remote, roots, versions, out.unknown_upstream, read, named)
    for found in found_leases:
        if not found.live:
            out.dead_leases.append(found)
            continue
        for tv in sorted(_closure(remote, list(found.versions()), versions, out.unknown_upstream, read, named)
                         - keep):
            out.leased.setdefault(tv, []).append(found.describe())
    return keep | set(out.leased)


def not_kept(remote: Remote, listing: dict[str, tuple[int, float]], entries: dict[str, dict] | None,
             read: Callable[[str], bytes] | None = None) -> tuple[set[tuple[str, int]], list[Found]]:
    """(the complete versions at the URL that its gc would remove, its live damaged leases). Removed (`keep_rule`,
    as `plan` keeps): replaced by a newer current one or switched away from, read under no live lease, and made
    nothing kept. A pull of the whole URL copies none of them (store/remote_pull.py), as push sends none of a local
    store's (store/gc.py `not_kept`): one is tens of GB at 1M samples. `entries`: the URL's store.json's tables, as
    the caller read them after `listing` (None: no store.json, then no version is removed). No version is told
    removed (an empty set) where every complete version is current (the usual store: nothing read), where the
    server's clock cannot be read (credentials that may not write: leases not judged, said here), or while a live
    lease is damaged (it may name any version: store/lease.py `live_versions`): those leases are returned for the
    caller to name in its own words (store/lease.py `warn_damaged`). `read`: `read_once(remote)` shared with the
    caller (a pull copies the versions whose records it read)."""
    versions = _versions(listing)
    complete = {tv for tv, v in versions.items() if v.complete}
    if entries is None or all_current(entries, complete):
        return set(), []
    try:
        now = remote.now()
    except PermissionError as e:
        log.warning("%s: the server's clock not read (%s); versions its gc would remove are pulled too",
                    remote.url, e)
        return set(), []
    found = remote_lease.leases(remote, listing, now)
    damaged = live_versions(found)[1]
    if damaged:  # which versions it keeps cannot be told; leaving garbage out is optional: keep every one
        return set(), damaged
    return complete - keep_rule(remote, versions, entries, RemoteGcPlan(), read or read_once(remote), found), []


def _strays(remote: Remote, kept: list[Version], now: float, grace_s: float,
            read: Callable[[str], bytes] | None = None) -> list[str]:
    """Objects of these complete versions that their checksums.json does not list, untouched for the grace
    period. Two pushes of different stores into one empty prefix race for a version number: the loser's
    write-once shards stay inside the winner's version, which `store verify` then reports for ever ("not listed")
    and no reader reads. One GET of checksums.json per kept version (`read`: the closure's); one unreadable: nothing
    removed from it."""
    out = []
    for v in kept:
        ages = {rel[len(v.name) + 1:]: now - t for rel, (_, t) in v.objects.items()}
        if all(name in (fmt.CHECKSUMS, fmt.MANIFEST) or age < grace_s for name, age in ages.items()):
            continue  # nothing old enough to judge: no GET
        try:
            listed = version_files((read or remote.read)(f"{v.name}/{fmt.CHECKSUMS}"), f"{v.name}/{fmt.CHECKSUMS}")
        except (FileNotFoundError, UserError):  # gone or damaged: `store verify` names it; nothing judged here
            continue
        out += [f"{v.name}/{name}" for name, age in sorted(ages.items())
                if name not in listed and name != fmt.CHECKSUMS and age >= grace_s]
    return out


def _stale_uploads(remote: Remote, now: float, grace_s: float, held: set[tuple[str, int]]) -> list[tuple[str, str]]:
    """S3 multipart uploads under the prefix started more than `grace_s` ago and not in a version a live lease
    holds: a push killed mid-shard (a shard of 32 MiB or more goes in parts: store/remote.PART) leaves its parts
    stored, and billed, but in no listing of objects, so nothing else would ever remove them."""
    if not remote.is_s3:
        return []
    bucket, _, prefix = remote.root.partition("/")
    prefix = f"{prefix}/" if prefix else ""
    found, marker = [], {}
    while True:
        try:
            page = remote.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker)
        except PermissionError:  # credentials without s3:ListBucketMultipartUploads: nothing gc can do about them
            return found
        for u in page.get("Uploads") or []:
            m = _OBJECT_RE.fullmatch(u["Key"][len(prefix):])
            started = u["Initiated"].timestamp()
            if now - started >= grace_s and not (m and (m.group(1), int(m.group(2))) in held):
                found.append((u["Key"], u["UploadId"]))
        if not page.get("IsTruncated"):
            return found
        marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}


def _still_doomed(remote: Remote, v: Version) -> list[str]:
    """Right before the DELETE: who keeps `v` now (a lease written, or v made current, since the plan)."""
    keepers = []
    if (_current(remote) or {}).get(v.table) == v.version:
        keepers.append("it is current now")
    return keepers + _leased_by(remote, v)


def _leased_by(remote: Remote, v: Version, since: dict[str, tuple[int, float]] | None = None) -> list[str]:
    """The live leases naming `v` now: one listing of `.leases/` (not the whole prefix: ~40k objects a version),
    one GET per lease. With `since` (`v.leases_seen`: the leases found live at the look before, with their listed
    size and LastModified) those still listed the same are not read again (~64 GETs at 8 nodes of 8 ranks): they
    name what they named then (naming one more version makes the record longer), which was not `v`. Sets
    `v.leases_seen`."""
    listing = remote.listing_times(remote_lease.LEASES_DIR)
    unread = {rel: info for rel, info in listing.items() if since is None or since.get(rel) != info}
    found = remote_lease.leases(remote, unread) if unread else []  # none: no clock probe either
    v.leases_seen = {rel: listing[rel] for f in found if f.live and (rel := str(f.path)) in listing}
    if since is not None:
        v.leases_seen.update({rel: info for rel, info in since.items() if listing.get(rel) == info})
    return [f.describe() for f in found if f.live and (v.table, v.version) in set(f.versions())]


def _still_dead(remote: Remote, p: RemoteGcPlan, removed: set[tuple[str, int]]) -> tuple[list[Found], list[Found]]:
    """Right before their DELETE: (the plan's dead leases to delete, those kept). One rule: deleted iff still
    dead now OR naming a version this run removed (`removed`). A paused reader that woke since the plan rewrote its
    lease (young now: live) and is kept - unless it woke between `_still_doomed`'s look and the manifest DELETE: it
    found its version intact and reads on, and kept (young) its beats would never look at that version again;
    deleted, its next beat stops it (LeaseLost: a removed lease object is never written again). One listing of
    `.leases/`, one GET per dead lease; a refresh between this look and the DELETE (one request) is lost: that
    reader stops, whatever was kept."""
    if not p.dead_leases:
        return [], []
    now_listed = remote.listing_times(remote_lease.LEASES_DIR)
    planned = {rel: now_listed[rel] for f in p.dead_leases if (rel := str(f.path)) in now_listed}  # gone: released
    doomed, kept = [], []
    for found in remote_lease.leases(remote, planned):
        (doomed if not found.live or removed & set(found.versions()) else kept).append(found)
    return doomed, kept


def _dry_run_clock(remote: Remote, echo: Callable[[str], None]) -> float:
    """The server's clock; where these credentials may not write its probe (a dry run is what a read-only key is
    handed out for), this machine's, said so: a dry run removes nothing, so a skewed age misleads no DELETE."""
    try:
        return remote.now()
    except PermissionError as e:
        echo(f"note: could not write a clock probe to {remote.url} ({str(e).splitlines()[0] if str(e) else e}); "
             "ages below are on this machine's clock")
        return time.time()


def collect(url: str, dry_run: bool = False, grace_s: float = GRACE_SECONDS,
            echo: Callable[[str], None] = print, storage_options: dict[str, Any] | None = None) -> RemoteGcPlan:
    url = url.rstrip("/")
    remote = open_remote(url, storage_options)
    with remote_errors(url, "gc"):
        p = plan(remote, grace_s, _dry_run_clock(remote, echo) if dry_run else None)
        _say_plan(p, dry_run, grace_s, echo)
        if dry_run:
            echo(f"dry run: {len(p.remove)} version(s), {size_text(p.nbytes)} would be freed")
            return p
        removed, held = _remove_versions(remote, p, echo)
        gone = {(v.table, v.version) for v in removed} - held  # a held one's lease reads on
        dead = _dead_leases(remote, p, gone, echo)
        remote.delete([str(f.path) for f in dead] + p.leftovers + p.strays)
        _abort_uploads(remote, p.uploads)
        echo(f"gc {url}: {len(removed)} version(s) removed, "
             f"{size_text(sum(v.nbytes for v in removed if (v.table, v.version) not in held))} freed")
        p.remove = removed
    return p


def _say_plan(p: RemoteGcPlan, dry_run: bool, grace_s: float, echo: Callable[[str], None]) -> None:
    """What the plan removes and keeps, and why, one line each (a dry run's whole answer)."""
    would = "would remove" if dry_run else "remove"
    for v in p.remove:
        what = "" if v.complete else (f" (incomplete: no manifest, newest object "
                                      f"{(p.now - v.newest) / 60:.0f} min old; a killed push or gc)")
        echo(f"{would} {v.name}{what}")
    for (table, v), by in sorted(p.leased.items()):
        echo(f"keep {table}/v{v}: not current, but held by " + "; ".join(by))
    for line in unswitched_lines(p.unswitched):
        echo(line)
    for v in p.young_incomplete:
        echo(f"keep {v.name}: incomplete, its newest object is {(p.now - v.newest) / 60:.0f} min old "
             f"(a push may still be writing it; removed once {grace_s / 60:.0f} min old)")
    for found in p.dead_leases:  # who it was and why it is dead: pid gone here, or not refreshed for long
        echo(f"{would} the lease of a gone process: {found.describe()}")
    if p.leftovers:
        echo(f"{would} {len(p.leftovers)} leftover(s) of killed commands ({CLOCK_DIR}/ probes, "
             f"{UPLOAD_DIR}/ temp files)")
    if p.strays:
        echo(f"{would} {len(p.strays)} object(s) in kept versions that their {fmt.CHECKSUMS} does not list (a "
             "push that lost the race for that version number wrote them): " + ", ".join(p.strays[:3])
             + (f" and {len(p.strays) - 3} more" if len(p.strays) > 3 else ""))
    if p.uploads:
        echo(f"{'would abort' if dry_run else 'abort'} {len(p.uploads)} unfinished multipart upload(s) of killed "
             "pushes (their parts are stored, and billed, but are no object)")
    for line in unknown_lines(p.unknown_upstream):
        echo(line)


def _remove_versions(remote: Remote, p: RemoteGcPlan, echo: Callable[[str], None]
                     ) -> tuple[list[Version], set[tuple[str, int]]]:
    """Each planned version deleted, manifest first, unless something keeps it now: (those whose manifest went,
    those of them whose data a lease taken meanwhile holds)."""
    from tqdm import tqdm

    removed, held = [], set()  # held: (table, version) whose data a lease taken meanwhile keeps
    if doomed := {(v.table, v.version) for v in p.remove} & p.was_current:
        _forget_removed(remote, doomed)
    for v in tqdm(p.remove, desc=f"gc {remote.url}", unit="version"):
        keepers = _still_doomed(remote, v)
        if keepers:
            echo(f"keep {v.name}: {'; '.join(keepers)} (since the plan)")
            continue
        manifest = f"{v.name}/{fmt.MANIFEST}"
        if manifest in v.objects:
            remote.delete([manifest])  # the version stops existing here
        fmt.crash_point("remote_gc_after_manifest")
        removed.append(v)
        # A reader that wrote its lease after the look above and found the manifest before its DELETE reads on:
        # its lease is listed now (its PUT came before its look, which came before the DELETE), so its data
        # stays - an incomplete version a later gc removes once no lease names it. A reader's look from now on
        # finds no manifest and stops.
        if holders := _leased_by(remote, v, since=v.leases_seen):
            echo(f"keep the data of {v.name} (its manifest is removed: no new reader opens it): held since "
                 f"the look before that by {'; '.join(holders)}; a later gc removes it once no lease names it")
            held.add((v.table, v.version))
            continue
        remote.delete(sorted(set(v.objects) - {manifest}))
        if (v.table, v.version) in p.markers:
            remote.delete([p.markers[(v.table, v.version)]])
    return removed, held


def _forget_removed(remote: Remote, doomed: set[tuple[str, int]]) -> None:
    """Before any DELETE: the numbers of the versions to remove leave store.json's `was_current` (compare-and-swap;
    no write when none is there), as a later version of that number is another one, never current (store/gc.py's
    `_forget_removed`). A kill after this, or a version kept since the plan, is taken for never current: kept until
    a newer one is current."""
    from store.checksum import seal

    def update(old: bytes | None) -> bytes | None:
        if old is None:
            return None
        rec = _parse_record(old, remote.url)
        tables = fmt.forget_was_current(rec["tables"], lambda t, v: (t, v) in doomed)
        if tables is None:
            return None
        return seal({**rec, "tables": tables, "format_version": fmt.STORE_FORMAT_VERSION})

    remote.swap(fmt.STORE_JSON, update)


def _dead_leases(remote: Remote, p: RemoteGcPlan, gone: set[tuple[str, int]], echo: Callable[[str], None]
                 ) -> list[Found]:
    """The plan's dead leases to delete now (`_still_dead`), saying which were refreshed since the plan."""
    dead, refreshed = _still_dead(remote, p, gone)
    for found in refreshed:
        echo(f"keep the lease of {found.record.get('what', '?')} ({found.path.name}): refreshed since the plan")
    for found in dead:
        if found.live:  # refreshed too late: it names what this run removed
            names = ", ".join(f"{t}/v{v}" for t, v in sorted(gone & set(found.versions())))
            echo(f"remove the lease of {found.record.get('what', '?')} ({found.path.name}): refreshed since the "
                 f"plan, but {names} is removed now (its process stops at its next refresh)")
    return dead


def _abort_uploads(remote: Remote, uploads: list[tuple[str, str]]) -> None:
    bucket = remote.root.partition("/")[0]
    for key, upload in uploads:
        try:
            remote.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
        except FileNotFoundError:  # completed or aborted meanwhile
            pass
