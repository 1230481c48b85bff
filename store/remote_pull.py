"""`pipeline store pull`: copy a URL's committed versions into a local store folder (what push and pull share, and
the layout at the URL: store/remote_sync.py).

Pull downloads into `<table>/.v<N>.pull/` (not a version name: readers ignore it), checks every file's CRC32C
against the version's sealed `checksums.json` as it arrives (a damaged object is refused, naming it), fetches the
manifest last and renames the folder to `v<N>` - the local commit, exactly as a writer's. A rerun keeps the files
already fetched and checked. A local copy of a version there already is checked to be the same one (else a
conflict) and refilled where files went missing (`refill`). The rows of the URL's `quarantine.parquet` are merged
into the local file (`pull_quarantine`).
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from schemas import atomic_write
from schemas.byte_bar import byte_bar
from schemas.errors import UserError
from schemas.temp_files import temp_of
from store import format as fmt
from store import integrity, remote_checked, remote_endpoint, remote_lease
from store.io_errors import is_not_writable
from store.lease import process_tag, warn_damaged
from store.remote import Remote, SharedBar, each_at_once, lost_object, lost_version, open_remote, remote_errors
from store.remote_shards import is_lazy
from store.remote_sync import (_MANIFEST_RE, SyncSummary, _conflict, _File, _ordered, damaged_quarantine,
                               marker_rel, remote_record, version_files)

log = logging.getLogger("store")

PULL_SUFFIX = ".pull"


def pull(url: str, dst: Path, storage_options: dict[str, Any] | None = None,
         tables: list[str] | None = None, optional: tuple[str, ...] = (), damaged_ok: bool = False,
         every_version: bool = False, record: dict[str, Any] | None = None) -> SyncSummary:
    """Every complete remote version the local store lacks that the URL's gc keeps (store/remote_gc.py
    `not_kept`: one replaced by a newer current version or switched away from, read under no live lease and made
    nothing kept, is not copied: `summary.garbage`); with `tables`, only those tables' current versions (what a
    reader opening them needs: store/remote_cache.py), of which those in `optional` may be missing.
    Versions that `store repair` replaced (a `<table>/v<N>.damaged.json` marker on the remote) are not copied.
    `damaged_ok` (repair's working copy, store/remote_work.py): an object that does not match its checksums is
    kept as it is, for repair to find, and named in the summary's `damaged`, instead of refused; a version marked
    damaged in `dst` (a killed repair replaced it there already) is not pulled again. `every_version` (repair's
    working copy, which looks at every version there): those the URL's gc would remove are copied too. `record`:
    the URL's store.json as the caller read it already (store/remote_work.py), not fetched again (nor by the
    URL's `not_kept`)."""
    from store.remote_gc import not_kept, read_once
    from store.store import Store

    dst = Path(dst)
    remote = open_remote(url, storage_options)
    summary = SyncSummary("pull", url)
    with remote_errors(url, "pull"), _writing_into(dst, url):
        if tables is not None and _all_cached(remote, dst, tables, summary, damaged_ok, record):
            return summary
        whole = tables is None and not every_version  # then what the URL's gc would remove is not copied
        listing, times = _listing(remote, whole)
        rec = record if record is not None else remote_record(remote, listing)
        rec, tables, wanted = wanted_versions(rec, url, tables, optional, listing)
        # (complete versions the URL's gc would remove, one rule with gc and push: not copied, `summary.garbage`;
        # those a pull names, `tables`' current ones, always are)
        # (`read`: each version's checksums.json the keep rule read - megabytes at 1M samples - not read again to
        # copy it; versions never change under their number, and each object copied is checked against it)
        read = read_once(remote)
        garbage, damaged = not_kept(remote, times, rec["tables"], read) if whole else (set(), [])
        warn_damaged(url, damaged, "every complete version is pulled, those the URL's gc would remove too")
        _refuse_lost_current(remote, rec, tables, listing)
        store = Store(dst)
        versions = _versions_to_pull(listing, tables, wanted, dst, damaged_ok)
        # (a copy of one here already is checked and refilled as before)
        skipped = [(t, v) for t, v in versions if (t, v) in garbage and not fmt.version_dir(dst, t, v).exists()]
        summary.garbage = [f"{t}/v{v}" for t, v in skipped]
        versions = [tv for tv in versions if tv not in skipped]
        lease = _hold_pulling(remote, versions, dst)
        try:
            _pull_versions(remote, dst, versions, summary, damaged_ok, read)
        finally:  # held till every version is copied: a gc meanwhile keeps them
            if lease is not None:
                lease.release()
        if fmt.QUARANTINE in listing:
            pull_quarantine(remote, dst, damaged_ok)
        for table, entry in sorted(rec["tables"].items()):
            if tables is not None and table not in tables:
                continue
            if fmt.is_complete(fmt.version_dir(dst, table, int(entry["current"]))):
                # a copy of a version the URL switched away from is garbage here too (the local gc's tell)
                left = {v for v in fmt.was_current(entry) if fmt.is_complete(fmt.version_dir(dst, table, v))}
                store.set_current(table, int(entry["current"]), also=left)
    return summary


@contextmanager
def _writing_into(dst: Path, url: str) -> Iterator[None]:
    """A pull's write refused in `dst` (a read-only mount: EROFS; another account's folder: EACCES) as one line
    naming the file (a version's as its final folder: `_pull_version`) and what to do. Errors
    naming no path in `dst` pass: the URL's (S3's access denied names none; a file:// URL's own path), and a full
    disk (its callers' lines: the CLI's, the cache's)."""
    try:
        yield
    except OSError as e:
        name = e.filename
        if not is_not_writable(e) or name is None or not Path(os.path.abspath(os.fsdecode(name))).is_relative_to(
                os.path.abspath(dst)):
            raise
        raise UserError(f"cannot write the pull of {url} into {dst}: {os.fsdecode(name)} is not writable "
                        f"({e.strerror or e}); make {dst} writable (its permissions, a read-write mount) or pull "
                        "into another folder") from None


def _all_cached(remote: Remote, dst: Path, tables: list[str], summary: SyncSummary, damaged_ok: bool,
                rec: dict[str, Any] | None = None) -> bool:
    """A reader's warm open: are the current versions of `tables` all in `dst` already? Then one GET of store.json
    (none when the caller read it: `rec`) and one of each version's checksums.json (a version that differs is
    refused) replace the listing of the whole prefix (thousands of objects for a large store); False sends the
    caller the full way."""
    from store.store import Store

    if not (dst / fmt.STORE_JSON).is_file():
        return False
    if rec is None and (rec := remote_record(remote, None)) is None:
        return False
    if not set(tables) <= set(rec["tables"]):
        return False
    wanted = [(t, int(rec["tables"][t]["current"])) for t in tables]
    if not all(fmt.is_complete(fmt.version_dir(dst, t, v)) for t, v in wanted):
        return False
    for t, v in wanted:
        where = f"{remote.url}/{t}/v{v}/{fmt.CHECKSUMS}"
        record = _read_checksums(remote, t, v)
        files = _ordered(t, v, version_files(record, where), record)
        if not _same_version(fmt.version_dir(dst, t, v), record, files):
            raise _conflict(t, v, remote.url, dst)
        if not damaged_ok or is_lazy(fmt.version_dir(dst, t, v)):  # as `_pull_versions` below
            refill(remote, dst, t, v, files, summary, damaged_ok)
        summary.present.append(f"{t}/v{v}")
    store = Store(dst)
    for t, v in wanted:
        store.set_current(t, v)
    return True


def _listing(remote: Remote, whole: bool) -> tuple[dict[str, int], dict[str, tuple[int, float]] | None]:
    """The URL's listing ({rel: size}) and, for a pull of the whole URL (`whole`), its times too (the URL's gc
    judges versions by them: store/remote_gc.py `not_kept`)."""
    if not whole:
        return remote.listing(), None
    times = remote.listing_times()
    return {rel: size for rel, (size, _) in times.items()}, times


def wanted_versions(rec: dict[str, Any] | None, url: str, tables: list[str] | None, optional: tuple[str, ...],
                    listing: dict[str, int] | None) -> tuple[dict[str, Any], list[str] | None, set[tuple[str, int]]]:
    """What a pull or a cache open of `url` takes: (its store record, the tables asked for that it has, the
    versions): `tables`' current versions (those in `optional` may be missing; an empty prefix when all are), or
    with `tables=None` every complete version in `listing` that `store repair` did not retire."""
    if rec is None and tables is not None and set(tables) <= set(optional):
        rec = fmt.new_store_record()  # an empty prefix, of which nothing is needed: a store's first writer
    if rec is None:
        raise UserError(remote_endpoint.not_s3(url) or f"no store at {url} (no {fmt.STORE_JSON} there); check the "
                        "URL, or push a store first")
    if tables is None:
        listing = listing or {}
        return rec, None, {(m.group(1), int(m.group(2))) for rel in listing if (m := _MANIFEST_RE.fullmatch(rel))
                           and marker_rel(m.group(1), int(m.group(2))) not in listing}
    tables = [t for t in tables if t in rec["tables"] or t not in optional]
    missing = sorted(set(tables) - set(rec["tables"]))
    if missing:
        raise UserError(f"no table {', '.join(missing)} in the store at {url} (tables: "
                        f"{sorted(rec['tables']) or 'none'}); run the stage that writes it and push again")
    return rec, tables, {(t, int(rec["tables"][t]["current"])) for t in tables}


def _refuse_lost_current(remote: Remote, rec: dict[str, Any], tables: list[str] | None,
                         listing: dict[str, int]) -> None:
    """A current version (of `tables`, or of every table) without its manifest in the listing: lost on the remote
    (`lost_version`), or changed since the listing (a rerun sees it). Before, pull copied nothing of it and reported
    success ("copied nothing new")."""
    for t in sorted(rec["tables"] if tables is None else tables):
        v = int(rec["tables"][t]["current"])
        if f"{t}/v{v}/{fmt.MANIFEST}" in listing or marker_rel(t, v) in listing:
            continue
        raise lost_version(remote, t, v) or UserError(f"pull {remote.url}: {t} v{v} changed while it was listed (a "
                                                      "push or gc meanwhile); rerun")


def _versions_to_pull(listing: dict[str, int], tables: list[str] | None, wanted: set[tuple[str, int]], dst: Path,
                      damaged_ok: bool) -> list[tuple[str, int]]:
    """The complete versions of the listing a pull copies (or refills): those of `wanted` when `tables` is given,
    never one `store repair` retired, nor - repair's working copy - one a killed repair replaced in `dst` already."""
    out = []
    for rel in sorted(listing):
        m = _MANIFEST_RE.fullmatch(rel)
        if not m:
            continue
        table, version = m.group(1), int(m.group(2))
        if tables is not None and (table, version) not in wanted:
            continue
        if marker_rel(table, version) in listing:
            continue
        if damaged_ok and fmt.damaged_marker(dst, table, version).exists():  # replaced here by a killed repair
            continue
        out.append((table, version))
    return out


def _hold_pulling(remote: Remote, versions: list[tuple[str, int]], dst: Path) -> remote_lease.RemoteLease | None:
    """A read lease naming the versions a pull copies, as every reader of a URL holds one: a `store gc` elsewhere
    during a pull of hours removed those no longer current from under it (the pull stopped at the first object
    gone, and its rerun found the version no more). Written before their manifests are looked at again, as
    store/remote_lease.hold_reading does: one a gc deleted before it could see the lease is refused. None with
    nothing to copy, or with credentials that may not write (warned; the pull goes on without). Lost (the process
    paused past its margin), it stops reads of `dst` only."""
    if not versions:
        return None
    try:
        lease = remote_lease.hold(remote, versions, "store pull", scope=str(dst))
    except PermissionError as e:
        log.warning("%s: no read lease (%s); a `store gc` meanwhile could remove versions this pull copies",
                    remote.url, e)
        return None
    if gone := [f"{t} v{v}" for t, v in versions if not remote.exists(f"{t}/v{v}/{fmt.MANIFEST}")]:
        lease.release()
        raise UserError(f"{remote.url}: {gone[0]} was removed (by `store gc`) while this pull listed it; rerun to "
                        "copy what is there now")
    return lease


def _pull_versions(remote: Remote, dst: Path, versions: list[tuple[str, int]], summary: SyncSummary,
                   damaged_ok: bool, read: Callable[[str], bytes] | None = None) -> None:
    """Each version into `dst`: a copy there already is checked to be the same and refilled, the others fetched.
    `read`: the URL's objects as the caller's keep rule read them already (store/remote_gc.py `read_once`)."""
    url = remote.url
    plan: list[tuple[str, int, bytes, list[_File]]] = []
    for table, version in versions:
        record = _read_checksums(remote, table, version, read)
        files = _ordered(table, version, version_files(record, f"{url}/{table}/v{version}/{fmt.CHECKSUMS}"),
                         record)
        vdir = fmt.version_dir(dst, table, version)
        if vdir.exists():
            if not _same_version(vdir, record, files):
                raise _conflict(table, version, url, dst)
            # repair's working copy keeps what it pulled as it is, for its scan; a version it holds lazily
            # (opened as an older one by a killed run, current since) is completed all the same
            if not damaged_ok or is_lazy(vdir):
                refill(remote, dst, table, version, files, summary, damaged_ok)
            summary.present.append(f"{table}/v{version}")
            continue
        plan.append((table, version, record, files))
    total = sum(f.nbytes for *_, files in plan for f in files)
    with byte_bar(total, f"pull {url}") as bar:
        for table, version, record, files in plan:
            _pull_version(remote, dst, table, version, files, bar, summary, damaged_ok)
            summary.copied.append(f"{table}/v{version}")


def _read_checksums(remote: Remote, table: str, version: int, read: Callable[[str], bytes] | None = None) -> bytes:
    """A version's checksums.json (through `read`, `remote.read` by default); one gone while its manifest is still
    there (or with its whole version, which store.json names current) is lost, not removed by a gc meanwhile (gc
    deletes the manifest first, of versions no longer current): named in one line (`lost_object`), where "rerun"
    would fail the same way for ever."""
    rel = f"{table}/v{version}/{fmt.CHECKSUMS}"
    try:
        return read(rel) if read else remote.read(rel, small=True)
    except FileNotFoundError as e:
        lost = lost_object(remote, rel, e)
        if lost is None:  # the bucket gone, or the version with a gc: remote_errors says rerun
            raise
    raise lost


def _same_version(vdir: Path, record: bytes, files: list[_File]) -> bool:
    """Is the local `vdir` a copy of the remote version whose sealed checksums.json is `record`? Its own
    checksums.json is that record byte for byte (then any other difference is damage to this copy: refilled), or
    its manifest has the remote's CRC32C (a copy whose checksums.json was lost); else it is another store's."""
    try:
        if (vdir / fmt.CHECKSUMS).read_bytes() == record:
            return True
    except OSError:
        pass
    return fmt.is_complete(vdir) and remote_checked.known_crc(vdir / fmt.MANIFEST)[0] == files[-1].crc


def stale_files(vdir: Path, files: list[_File]) -> list[_File]:
    """The files of the local copy `vdir` that are missing or not their recorded size: one stat each (~20k for a
    1M-sample version), no read. A lazily cached version's shards not fetched yet are missing too: a pull takes
    the version whole (a whole open of the cache, repair's and migrate's working copy)."""
    out = []
    for f in files:
        try:
            size = os.stat(vdir / f.rel.rsplit("/", 1)[1]).st_size
        except FileNotFoundError:
            out.append(f)
            continue
        if size != f.nbytes:
            out.append(f)
    return out


def refill(remote: Remote, dst: Path, table: str, version: int, files: list[_File], summary: SyncSummary,
           damaged_ok: bool = False) -> None:
    """Fetch again the files of a local copy of a version that were deleted or cut short since (a user's rm, a full
    disk, a killed copy), and the shards of a lazily cached copy not fetched yet: found by `stale_files`, each
    checked as it streams to a temp name and renamed into place (never a partial file under the name), the manifest
    last; then the damage the readers recorded for them (`v<N>.damaged.json`) is cleared, so the repaired copy reads
    without a stale report. `damaged_ok` (repair's working copy): an object that fails its check is kept as it is
    for repair's scan, its damage record too."""
    from store.remote_shards import FETCH_TAG, is_shard

    vdir = fmt.version_dir(dst, table, version)
    stale = stale_files(vdir, files)
    if not stale:
        return
    lazy = is_lazy(vdir)
    # a lazily cached version's shards not fetched yet are expected there, not damage: no warning for those
    broken = [f for f in stale if not (lazy and is_shard(f.rel.rsplit("/", 1)[1])
                                       and not (vdir / f.rel.rsplit("/", 1)[1]).exists())]
    if broken:
        log.warning("%s: %d file(s) of %s v%d missing or of the wrong size (%s); fetching them again from %s",
                    vdir, len(broken), table, version, ", ".join(f.rel.rsplit("/", 1)[1] for f in broken[:5])
                    + (" ..." if len(broken) > 5 else ""), remote.url)
    intact: list[str] = []
    with byte_bar(sum(f.nbytes for f in stale), f"refill {table} v{version}") as bar:
        bar = SharedBar(bar)

        def fetch(f: _File) -> str:
            path = vdir / f.rel.rsplit("/", 1)[1]
            # in a cache, named as a shard fetch's temp file: a killed one's is removed by the next open there
            # (store/remote_cache._remove_dead_fetches), where `.NAME.tmp-PID` stayed, counted against its limit
            part = (path.with_name(f".{path.name}{FETCH_TAG}{process_tag()}-{threading.get_ident()}") if lazy
                    else temp_of(path))
            return fetch_checked(remote, f, path, bar, damaged_ok, part=part)

        def done(f: _File, how: str) -> None:
            if how == "damaged":
                summary.damaged.append(f.rel)
            else:
                intact.append(f.rel.rsplit("/", 1)[1])
            summary.sent(f)

        manifest = [f for f in stale if f.rel.endswith("/" + fmt.MANIFEST)]
        rest = [f for f in stale if f not in manifest]
        for f, how in zip(rest, each_at_once(fetch, rest)):
            done(f, how)
        for f in manifest:  # last, as a commit: the version is complete again only with every file back
            done(f, fetch(f))
    atomic_write.fsync_dir(vdir)
    integrity.clear_damage(vdir, intact)


def _pull_version(remote: Remote, dst: Path, table: str, version: int, files: list[_File], bar,
                  summary: SyncSummary, damaged_ok: bool = False) -> None:
    """Fetch one version into its pull folder, every file checked (several at a time); the rename is the commit."""
    final = fmt.version_dir(dst, table, version)
    tmp = final.with_name(f".{final.name}{PULL_SUFFIX}")
    try:
        _fetch_version(remote, dst, table, version, files, bar, summary, damaged_ok, tmp, final)
    except OSError as e:  # named by the version folder the user will look for, not its hidden pull folder
        if (named := atomic_write.named_as_final(e, tmp, final)) is not e:
            raise named from e
        raise


def _fetch_version(remote: Remote, dst: Path, table: str, version: int, files: list[_File], bar,
                   summary: SyncSummary, damaged_ok: bool, tmp: Path, final: Path) -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    bar = SharedBar(bar)

    def fetch(f: _File) -> str:
        return fetch_checked(remote, f, dst / f.rel.replace(f"{table}/v{version}/", f"{table}/{tmp.name}/", 1), bar,
                             damaged_ok)

    for f, how in zip(files, each_at_once(fetch, files)):  # several at a time: the rename below is the commit
        if how == "skipped":
            summary.objects_skipped += 1
            continue
        if how == "damaged":
            summary.damaged.append(f.rel)
        summary.sent(f)
    for p in tmp.iterdir():
        atomic_write.fsync_dir(p)  # os.fsync on a descriptor of the file
    atomic_write.fsync_dir(tmp)
    os.rename(tmp, final)
    atomic_write.fsync_dir(final.parent)


def fetch_checked(remote: Remote, f: _File, path: Path, bar, damaged_ok: bool = False,
                  part: Path | None = None) -> str:
    """One object into `path`, its size and CRC32C checked while it streams to `part` (default `NAME.part`) and
    renamed into place: never a partial file under the name. 'skipped' when `path` holds it already (an earlier
    run), 'sent', or - a difference with `damaged_ok` (pull for repair) - 'damaged', kept; any other difference
    raises. A file an earlier run fetched is trusted unread while its size and mtime are those recorded when it was
    checked (store/remote_checked.py), else read again."""
    if path.is_file() and remote_checked.known_crc(path) == (f.crc, f.nbytes):
        bar.update(f.nbytes)
        return "skipped"
    part = part if part is not None else path.with_name(path.name + ".part")
    try:
        crc = remote.download(f.rel, part, bar)
    except FileNotFoundError as e:
        part.unlink(missing_ok=True)
        return _missing_object(remote, f, e, damaged_ok)
    except BaseException:  # a full disk, a lost connection: no partial file is left behind
        part.unlink(missing_ok=True)
        raise
    size = part.stat().st_size
    if (size, crc) != (f.nbytes, f.crc) and not damaged_ok:
        part.unlink()
        raise damaged_object(remote.url, f, size, crc)
    if (size, crc) == (f.nbytes, f.crc):
        remote_checked.record(part, crc)  # before the rename: a name never carries a record of other bytes
    os.replace(part, path)
    return "sent" if (size, crc) == (f.nbytes, f.crc) else "damaged"


def _missing_object(remote: Remote, f: _File, e: FileNotFoundError, damaged_ok: bool) -> str:
    """An object its version's checksums.json lists is not there (`remote.lost_object`); repair's pull
    (`damaged_ok`) leaves a lost one missing for the scan to find ('damaged')."""
    lost = lost_object(remote, f.rel, e)
    if lost is None:
        raise e  # the bucket or the whole version went away meanwhile (a gc): remote_errors says rerun
    if damaged_ok:
        return "damaged"
    raise lost


def damaged_object(url: str, f: _File, nbytes: int, crc: str) -> UserError:
    """A fetched object whose bytes are not what its version's checksums.json records: refused, in one line."""
    return UserError(f"{url}/{f.rel} is damaged ({nbytes} bytes, crc32c {crc}; its version's {fmt.CHECKSUMS} "
                     f"records {f.nbytes} bytes, crc32c {f.crc}); refused: delete {url}/{f.rel} (objects are "
                     "never overwritten) and push that version again from an intact store")


def pull_quarantine(remote: Remote, dst: Path, damaged_ok: bool = False) -> int:
    """Add the remote's quarantine rows the local copy lacks; how many were new. A damaged remote file is refused
    in one line; with `damaged_ok` (repair's working copy) its bytes are copied as they are when the copy has no
    quarantine file yet, for repair's scan to find and set aside."""
    from store import quarantine

    try:
        data = remote.read(fmt.QUARANTINE, small=True)
    except FileNotFoundError:
        return 0
    rows, why = quarantine.parsed(data)
    if rows is None:
        if not damaged_ok:
            raise damaged_quarantine(remote.url, why)
        if not (dst / fmt.QUARANTINE).exists():
            fmt.atomic_write_bytes(dst / fmt.QUARANTINE, data)
        return 0
    return quarantine.merge_into(dst, rows)
