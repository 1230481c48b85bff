"""One version of a store at a URL written by ranks on several nodes, each node through its own cached copy.

A node's cache (store/remote_cache.py) is a local store only that node sees, so rank 0 cannot find the other
nodes' shards, indexes and rank-done files there, as it does on one disk. Instead each part travels to the remote
by itself, and only small files travel to rank 0:
- at the end of its loop (`TableWriter.finish_rank`) every rank uploads its own files of the version - schema.json
  and its shards, then their indexes, then its rank-done file (several at a time within each group), which lists each of those files' size and CRC32C - to
  `<table>/v<N>/` on the remote, write-once (store/remote.py: If-None-Match on S3). Without a manifest there the
  version is invisible (push's protocol), and a rerun skips every object already there with the same size and
  CRC32C;
- rank 0's commit (`commit_remote`) reads the other ranks' rank-done files and downloads their shard indexes
  (small; never their shards), merges every index into the manifest, writes checksums.json from its own files
  and the other ranks' recorded sizes and CRC32Cs, and commits in push's order: checksums.json, manifest.parquet
  (the version is complete from here on), then store.json by compare-and-swap;
- every rank then drops the version from its node's cache: it was never complete there (its shards are spread
  over the nodes), and the next reader pulls it through the cache like any other remote version.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from schemas import atomic_write
from schemas.byte_bar import byte_bar
from schemas.errors import UserError
from store import format as fmt
from store.checksum import crc_hex, file_crc
from store.manifest import read_indexes
from store.remote import SharedBar, _first_line, each_at_once, no_bucket, open_remote, remote_errors
from store.remote_upload import Mismatch
from store.writer_open import WORLD_JSON

if TYPE_CHECKING:
    from store.store import Store
    from store.writer import TableWriter

log = logging.getLogger("store")

#: which remote a cached store copies (written by store/remote_cache.local_store into the cache's store folder)
SOURCE_URL = "source-url.txt"
INDEX_SUFFIX = ".index.parquet"
COMMIT_SUFFIX = ".commit"  # `<table>/.v<N>.commit/`: rank 0's small files of the commit (not a version name)


def source_url(root: Path) -> str | None:
    """The URL whose cached copy `root` is; None for a store that is not a cache."""
    try:
        return (Path(root) / SOURCE_URL).read_text().strip() or None
    except (FileNotFoundError, NotADirectoryError):  # a path that is no folder is no cache either
        return None


def rank_files(vdir: Path, rank: int) -> dict[str, dict[str, Any]]:
    """{name: {nbytes, crc32c}} of this rank's part of the version: schema.json, its committed shards (their
    size and CRC32C as recorded in their index at commit, not read again) and their indexes."""
    files: dict[str, dict[str, Any]] = {}
    indexes = sorted(vdir.glob(f"{fmt.shard_prefix(rank)}*{INDEX_SUFFIX}"))  # committed shards (tars without: not)
    # each index read once: its two columns and its own size and CRC32C from the same bytes
    for index, read in zip(indexes, read_indexes(indexes, columns=("shard_nbytes", "shard_crc32c"))):
        shard = vdir / (index.name[: -len(INDEX_SUFFIX)] + ".tar")  # absent when adopted from the remote
        rows = read.rows
        crc = rows.column("shard_crc32c")[0].as_py() if "shard_crc32c" in rows.column_names and rows.num_rows else None
        if crc is None:  # a shard carried from a format-1 version: read it once
            crc, nbytes = file_crc(shard)
        else:
            nbytes = int(rows.column("shard_nbytes")[0].as_py())
        files[shard.name] = {"nbytes": nbytes, "crc32c": crc}
        files[index.name] = {"nbytes": read.measured[1], "crc32c": read.measured[0]}
    files[fmt.SCHEMA_JSON] = _entry(vdir / fmt.SCHEMA_JSON)
    if (vdir / WORLD_JSON).is_file():  # written at open (store/writer_open.record_world)
        files[WORLD_JSON] = _entry(vdir / WORLD_JSON)
    return files


def _entry(path: Path) -> dict[str, Any]:
    crc, n = file_crc(path)
    return {"nbytes": n, "crc32c": crc}


def _upload(remote, path: Path, rel: str, entry: dict[str, Any], listing: dict[str, int] | None, bar) -> None:
    """Write-once: an object already there must be this very file (a rerun), never overwritten. `listing`: the
    sizes listed where `rel` would be (None: it is looked up alone)."""
    if remote.has(rel, entry["nbytes"], entry["crc32c"], listing):
        bar.update(entry["nbytes"])
        return
    if not path.is_file():  # adopted from the remote (adopt_uploaded), where it now differs
        raise UserError(f"{remote.url}/{rel} no longer matches its index and is not in this node's cache; remove the "
                        "incomplete version on the remote (`pipeline store gc`) and rerun")
    try:  # never spread damage: the bytes sent must be what its rank recorded (checked as they are read, once)
        created = remote.upload(path, rel, entry["crc32c"], bar, entry["nbytes"])
    except Mismatch as e:
        raise UserError(f"{path} is damaged ({e}; recorded {entry['nbytes']} bytes, crc32c {entry['crc32c']}): "
                        "not sent; remove it and its index, then rerun to encode those samples again") from None
    if not created and not remote.has(rel, entry["nbytes"], entry["crc32c"]):
        raise UserError(f"{remote.url}/{rel} exists with other content (a part of another run of this version "
                        "number); remove the incomplete version on the remote (`pipeline store gc`) and rerun")


def _listing(remote, table: str, version: int) -> dict[str, int]:
    """Objects under `<table>/v<N>/` only (not the whole store), keyed as `remote.has` expects."""
    return remote.listing(f"{table}/v{version}")


def _rank_listing(remote, table: str, version: int, rank: int) -> dict[str, int]:
    """Rank `rank`'s shards and indexes under `<table>/v<N>/`, keyed as `remote.has` expects: a listing of their
    prefix, not of the version (~40k objects at 1M samples, listed by each of 64 ranks, where a rank's are ~600)."""
    return remote.listing(f"{table}/v{version}", prefix=fmt.shard_prefix(rank))


def upload_rank(writer: TableWriter, files: dict[str, dict[str, Any]]) -> None:
    """This rank's files of the version to the remote (write-once), its rank-done file last. Only its own shards'
    prefix is listed; the few other files (schema.json, world-size.json, its rank-done file) are each looked up
    alone."""
    url = str(writer.remote_url)
    remote = open_remote(url)
    base = f"{writer.table}/v{writer.version}"
    done = fmt.rank_done_name(writer.rank)
    with remote_errors(url, f"upload of rank {writer.rank}'s part of table '{writer.table}' v{writer.version}"):
        mine = fmt.shard_prefix(writer.rank)  # what the listing holds; the others: one request each
        listing = _rank_listing(remote, writer.table, writer.version, writer.rank)
        # who wrote the parts first (a rerun resumes them only with this schema and number of ranks:
        # taken_on_remote), shards before their indexes (an index there means its shard is: adopt_uploaded), the
        # rank-done file last
        head = (fmt.SCHEMA_JSON, WORLD_JSON)
        groups = [sorted((n, e) for n, e in files.items() if n in head),
                  sorted((n, e) for n, e in files.items() if n not in head and not n.endswith(INDEX_SUFFIX)),
                  sorted((n, e) for n, e in files.items() if n.endswith(INDEX_SUFFIX)),
                  [(done, _entry(writer.dir / done))]]
        total = sum(e["nbytes"] for group in groups for _, e in group)
        with byte_bar(total, f"upload r{writer.rank} {url}") as progress:
            bar = SharedBar(progress)
            for group in groups:  # several at a time within a group: a group ends before the next starts
                for _ in each_at_once(lambda f: _upload(remote, writer.dir / f[0], f"{base}/{f[0]}", f[1],
                                                        listing if f[0].startswith(mine) else None, bar), group):
                    pass


def adopt_uploaded(writer: TableWriter) -> None:
    """A rank whose node lost its cache (a replaced spot instance) but had uploaded shards of this version: their
    indexes (small) are fetched into the cache, so those shards count as committed (its keys are not encoded
    again, its upload skips them); the shards themselves stay on the remote. Only an index whose shard is there
    with the size the index records."""
    url, base = str(writer.remote_url), f"{writer.table}/v{writer.version}"
    remote = open_remote(url)
    with remote_errors(url, f"reading rank {writer.rank}'s part of table '{writer.table}' v{writer.version}"):
        listing = _rank_listing(remote, writer.table, writer.version, writer.rank)
        _drop_orphan_indexes(writer, base, listing)

        def adopt(rel: str) -> None:
            name = rel[len(base) + 1:]
            shard = f"{rel[: -len(INDEX_SUFFIX)]}.tar"
            if (writer.dir / name).is_file() or shard not in listing:
                return
            data = remote.read(rel, small=True)
            sizes = pq.read_table(pa.BufferReader(data), columns=["shard_nbytes"]).column("shard_nbytes").to_pylist()
            if sizes and int(sizes[0]) == listing[shard]:
                fmt.atomic_write_bytes(writer.dir / name, data)

        # one GET per index (a rank's share of ~20k at 1M samples): several at a time, as every transfer
        from tqdm import tqdm

        indexes = sorted(r for r in listing if r.endswith(INDEX_SUFFIX))
        with tqdm(total=len(indexes), desc=f"rank {writer.rank}: its uploaded indexes from {url}", unit="file",
                  dynamic_ncols=True) as bar:
            for _ in each_at_once(adopt, indexes):
                bar.update()


def _drop_orphan_indexes(writer: TableWriter, base: str, listing: dict[str, int]) -> None:
    """This rank's indexes in the cache whose shard is neither there nor on the remote with the size the index
    records: adopted by an earlier open, and the remote's copy gone since (a `store gc` removed the incomplete
    version while no run held it, e.g. that run was killed too). Removed, so their keys are encoded again: kept,
    they counted as committed and every rerun's upload refused the shard that no one had any more."""
    for index in sorted(writer.dir.glob(f"{fmt.shard_prefix(writer.rank)}*{INDEX_SUFFIX}")):
        shard = index.name[: -len(INDEX_SUFFIX)] + ".tar"
        if (writer.dir / shard).is_file():
            continue
        try:
            sizes = pq.read_table(index, columns=["shard_nbytes"]).column("shard_nbytes").to_pylist()
        except (pa.ArrowException, OSError, ValueError, KeyError) as e:  # a damaged disk, a killed copy, a hand edit
            # a copy of the remote's object (its shard is not here): dropped, it is adopted again just after when
            # its shard is on the remote, else its samples are encoded again
            log.warning("%s: cannot be read (%s); dropped: fetched again from %s if its shard is there, else its "
                        "samples are encoded again", index, _first_line(e), writer.remote_url)
            index.unlink()
            continue
        if not sizes or listing.get(f"{base}/{shard}") != int(sizes[0]):
            log.warning("%s: its shard is no longer on %s (nor in this cache); its samples are encoded again",
                        index, writer.remote_url)
            index.unlink()


def commit_remote(writer: TableWriter, allow_empty: bool) -> int:
    """Rank 0, after every rank's `finish_rank` (a barrier): the manifest from every rank's index, then the remote
    commit in push's order. Returns the version (`writer.newer_current`: the higher one another writer made
    current meanwhile, which stays current; None when ours is)."""
    url, table, version = str(writer.remote_url), writer.table, writer.version
    remote = open_remote(url)
    base = f"{table}/v{version}"
    staging = writer.dir.with_name(f".{writer.dir.name}{COMMIT_SUFFIX}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        with remote_errors(url, f"commit of table '{table}' v{version}"):
            listing = _listing(remote, table, version)
            recorded, dones = _gather(writer, remote, listing, staging)
            manifest_nbytes = _manifest(writer, staging, recorded, dones, allow_empty)
            with byte_bar(manifest_nbytes, f"commit {url}") as bar:
                _upload(remote, staging / fmt.CHECKSUMS, f"{base}/{fmt.CHECKSUMS}", _entry(staging / fmt.CHECKSUMS),
                        listing, bar)
                _still_there(writer, remote, staging)
                # the manifest last: the version is complete from here on
                _upload(remote, staging / fmt.MANIFEST, f"{base}/{fmt.MANIFEST}", _entry(staging / fmt.MANIFEST),
                        listing, bar)
            fmt.crash_point("after_manifest")
            current = make_current(remote, table, version)
            writer.newer_current = current if current != version else None
    finally:  # the small files fetched for the commit: a rerun fetches them again
        shutil.rmtree(staging, ignore_errors=True)
    writer.close()
    return version


def make_current(remote, table: str, version: int, over: int | None = None) -> int:
    """The last step of a commit on the remote: store.json by compare-and-swap, as push's (never over a higher
    version another writer committed since: the remote is never rolled back). Also all a rerun does when that step
    failed (stages/encode/nodes.py: the complete version is adopted, nothing encoded again). `over`: the current
    version the caller saw when it chose `version` (a rerun adopting a complete version of its settings, as a local
    store's rerun makes it current: store/store.py `find_version`): replaced even when higher, but only if it is
    still current. Returns the version current after it: `version`, or that higher one, which stays current (the
    caller must say so)."""
    from store.remote_push import _changed, _merged_record
    from store.remote_sync import _parse_record, newer_version

    newer: list[str] = []  # "table/vN", filled by the swap's last attempt

    def update(old: bytes | None) -> bytes | None:
        newer.clear()  # called again on every compare-and-swap attempt
        now = None if old is None else (_parse_record(old, remote.url)["tables"].get(table) or {}).get("current")
        wanted = {table: {"current": version}}
        if over is not None and now is not None and int(now) == over:  # what the caller chose to replace
            return _changed(old, _merged_record(old, wanted, remote.url, replacing={table: over}))
        return _changed(old, _merged_record(old, wanted, remote.url, newer=newer))

    remote.swap(fmt.STORE_JSON, update)
    return newer_version(newer, table) or version


def _gather(writer: TableWriter, remote, listing: dict[str, int],
            staging: Path) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Every rank's rank-done file, shard indexes, schema.json and world-size record into `staging` (small files;
    rank 0's own from its folder, the others' from the remote), each checked against its rank's record; returns
    every rank's record of its files, and the rank-done records. Every file a rank recorded must be on the remote
    with its size."""
    url, base = remote.url, f"{writer.table}/v{writer.version}"
    recorded: dict[str, dict[str, Any]] = {}
    dones: list[dict[str, Any]] = []
    missing = []
    for r in range(writer.world_size):
        done = fmt.rank_done_name(r)
        if f"{base}/{done}" not in listing:
            missing.append(r)
            continue
        own = r == writer.rank
        data = (writer.dir / done).read_bytes() if own else remote.read(f"{base}/{done}", small=True)
        (staging / done).write_bytes(data)
        dones.append(_rank_done(data, r, str(writer.dir / done) if own else f"{url}/{base}/{done}"))
        recorded.update(dones[-1]["files"])
    if missing:
        raise UserError(f"table '{writer.table}' v{writer.version}: ranks {missing} have not uploaded their part to "
                        f"{url}; rerun every node")
    from tqdm import tqdm

    mine = fmt.shard_prefix(writer.rank)
    small = []
    for name, entry in sorted(recorded.items()):
        if listing.get(f"{base}/{name}") != entry["nbytes"]:
            raise UserError(f"{url}/{base}/{name} is missing or incomplete on the remote; rerun every node")
        if name.endswith(".index.parquet") or name in (fmt.SCHEMA_JSON, WORLD_JSON):  # small: fetched, checked
            small.append((name, entry))

    def fetch(item: tuple[str, dict[str, Any]]) -> None:
        name, entry = item
        data = (writer.dir / name).read_bytes() if name.startswith(mine) else remote.read(f"{base}/{name}", small=True)
        (staging / name).write_bytes(data)
        if (len(data), crc_hex(data)) != (entry["nbytes"], entry["crc32c"]):  # the bytes fetched, not read again
            raise UserError(f"{url}/{base}/{name} does not match its rank's record; rerun every node")

    # one index per shard (~20k for a 1M-sample table), one round trip each, while every other rank waits at the
    # commit: several at a time (one after the other, the latency was the whole cost)
    with tqdm(total=len(small), desc=f"commit: the ranks' indexes from {url}", unit="file",
              dynamic_ncols=True) as bar:
        for _ in each_at_once(fetch, small):
            bar.update()
    return recorded, dones


def _rank_done(data: bytes, rank: int, where: str) -> dict[str, Any]:
    """A rank-done file parsed and checked for what the commit reads of it: a damaged one (a bad disk, a store
    copied by hand) is refused, naming it, rather than taken as that rank not done: its rank's rerun would find its
    own upload there with other content and be refused too (write-once), so it must be deleted first."""
    try:
        done = json.loads(data)
        files = done["files"]
        ok = done["rank"] == rank and isinstance(files, dict) and all(
            isinstance(done.get(count, 0), int) for count in ("given", "rejected")) and all(
            isinstance(e, dict) and isinstance(e.get("nbytes"), int) and isinstance(e.get("crc32c"), str)
            for e in files.values())
        why = "" if ok else f"not rank {rank}'s record of its files"
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        why = f"{type(e).__name__}: {e}"
    if why:
        raise UserError(f"{where} is damaged ({why}); nothing committed: delete it and rerun every node (rank {rank} "
                        "writes it again from its node's cache)")
    return done


def _manifest(writer: TableWriter, staging: Path, recorded: dict[str, dict[str, Any]], dones: list[dict[str, Any]],
              allow_empty: bool) -> int:
    """manifest.parquet and checksums.json in `staging` (as a writer on one disk writes them: the shards' sizes and
    CRC32Cs from the manifest, the small files' from their bytes); the manifest's size. Refused unless its rows
    plus the rejected samples are the keys the ranks were given."""
    from store.integrity import write_version_checksums
    from store.manifest import merge_runs
    from store.writer_commit import EmptyVersion, check_rows

    table, version = writer.table, writer.version
    # checksums.json takes each index's CRC32C from the bytes the merge read (each read once); checked below
    # against its rank's record, as the fetch checked the same file
    merged = merge_runs(sorted(staging.glob("shard-r*-*.index.parquet")))
    if merged.num_rows == 0 and not allow_empty:
        discard_parts(writer)
        raise EmptyVersion(f"table '{table}' v{version} would be empty: every input was rejected (reasons in each "
                        "node's cached quarantine.parquet); fix the inputs or the settings")
    check_rows(table, version, dones, merged.num_rows, required=True)
    with atomic_write.atomic_file(staging / fmt.MANIFEST) as f:  # streamed, never whole in memory (as a local commit)
        written = merged.write(f)
        write_version_checksums(staging, written.shards, written.measured, merged.measured,
                                counts=written.counts)
    listed = json.loads((staging / fmt.CHECKSUMS).read_bytes()).get("files", {})
    differs = [n for n, e in recorded.items()
               if n in listed and (listed[n]["nbytes"], listed[n]["crc32c"]) != (e["nbytes"], e["crc32c"])]
    if differs:
        raise UserError(f"table '{table}' v{version}: {differs[0]} differs from its index; rerun every node")
    return written.measured[1]


def discard_parts(writer: TableWriter) -> None:
    """A version with nothing to commit (every input rejected): every rank's part of it deleted from the remote, then
    rank 0's cached folder removed (the writer closed with it), as a writer on one disk removes its folder
    (`discard_version`). Left, the parts stayed under `<table>/v<N>/` until a `store gc` at the URL. Every object
    under the version is this run's: parts of another run make the number one the ranks do not write
    (`on_remote`'s `taken`). A kill midway leaves parts without a manifest: invisible, and gc's to remove."""
    from store.writer_commit import discard_version

    url, base = str(writer.remote_url), f"{writer.table}/v{writer.version}"
    remote = open_remote(url)
    with remote_errors(url, f"removing the empty table '{writer.table}' v{writer.version}"):
        remote.delete(sorted(_listing(remote, writer.table, writer.version)))
        if _listing(remote, writer.table, writer.version):
            raise UserError(f"{url}/{base}/ could not be removed; run `pipeline store gc {url}`")
    discard_version(writer)


def _still_there(writer: TableWriter, remote, staging: Path) -> None:
    """Right before the manifest, one listing of the version: every object checksums.json lists (but the manifest)
    is there with its size. The ranks' push leases keep the parts from `store gc`, but a gc that checked the
    leases just before one was written deletes a moment later; the manifest then would commit a version whose
    data is gone."""
    url, base = remote.url, f"{writer.table}/v{writer.version}"
    listed = json.loads((staging / fmt.CHECKSUMS).read_bytes())["files"]
    there = _listing(remote, writer.table, writer.version)
    gone = sorted(n for n, e in {**listed, fmt.CHECKSUMS: _entry(staging / fmt.CHECKSUMS)}.items()
                  if n != fmt.MANIFEST and there.get(f"{base}/{n}") != e["nbytes"])
    if gone:
        raise UserError(f"{url}/{base}/{gone[0]}{f' and {len(gone) - 1} more' if len(gone) > 1 else ''} disappeared "
                        "from the remote before the commit (a `store gc`?); nothing committed; rerun every node")


def hold_parts(writer: TableWriter):
    """A push lease on the version the writer opened (store/remote_lease.py): `store gc` keeps its parts, which have
    no manifest yet, for as long as the writer is open (rank 0's: until store.json names the version)."""
    from store.remote_lease import hold

    url = str(writer.remote_url)
    with remote_errors(url, f"the push lease of table '{writer.table}' v{writer.version}"):
        return hold(open_remote(url), [(writer.table, writer.version)],
                    f"rank {writer.rank} writing {writer.table} v{writer.version}", kind="push")


class OnRemote(NamedTuple):
    taken: set[int]  # version numbers this run cannot write
    committed: int = 0  # the newest complete version of this schema but the current one (0: none)
    rows: int = 0  # its samples
    current: int = 0  # the remote's current version of the table when listed (0: none)


def on_remote(url: str, table: str, want: dict, world: int,
              same: Callable[[Any], bool] | None = None) -> OnRemote:
    """What the remote holds of `table`: the version numbers `world` ranks with schema `want` cannot write -
    complete ones, and parts of another run (its schema.json differs or is missing, or they were written by another
    number of ranks, or that number is not recorded); parts of this very run are resumed - and the newest complete
    version of this very schema other than the current one (which the rerun's own look at its cache finds): a
    commit whose manifest was written and whose store.json swap failed (a lost connection, a kill), or one that
    lost the swap to another writer's newer version, or simply an older one another run's settings replaced. Its
    rerun adopts it (only the swap is redone, `make_current` over the current one, as a local store's rerun makes
    the version of its lineage current: store/store.py `find_version`) instead of encoding everything again into
    the next number; its nodes' caches dropped their parts after the commit.
    `same`: which complete version's schema.json (parsed JSON, None when unreadable) serves this run; default
    equal to `want` (resize-bucket compares lineages only, as its cache's `find_version` does; encode accepts
    settings that only add columns too, `serving_schemas`). Parts are resumed only of `want` itself.
    Requests: one listing of the table's folder level (`_version_folders`), then a lookup or a few per version, 16
    versions at a time (`_judged`): never a listing of the versions' own objects (~40k each at 1M samples)."""
    same = same or (lambda found: found == want)
    remote = open_remote(url)
    with remote_errors(url, f"listing table '{table}'"):
        numbers, beside = _version_folders(remote, table)
        current = _current_of(remote, table)
        candidates = _candidates(table, numbers, beside, current)
        adoptable = set(candidates)
        judged = dict(zip(numbers, each_at_once(
            lambda v: _judged(remote, f"{table}/v{v}", want, world, same if v in adoptable else None), numbers)))
        taken = {v for v, (resumable, _) in judged.items() if not resumable}
        if v := next((v for v in candidates if judged[v][1]), 0):
            return OnRemote(taken, v, _rows(remote, f"{table}/v{v}/{fmt.MANIFEST}"), current)
    return OnRemote(taken, current=current)


def committed_on_remote(url: str, table: str, same: Callable[[Any], bool]) -> int:
    """Only `on_remote`'s `committed` (0: none): no part judged for a writer (`taken`), no row count read; each
    version's manifest looked up and schema.json read only of complete ones, newest first, until one serves."""
    remote = open_remote(url)
    with remote_errors(url, f"listing table '{table}'"):
        numbers, beside = _version_folders(remote, table)
        candidates = _candidates(table, numbers, beside, _current_of(remote, table))
        return _newest_committed(remote, table, candidates, same)


def _version_folders(remote, table: str) -> tuple[list[int], set[str]]:
    """One listing of the table's folder level (S3: a `/`-delimited listing, one request per 1,000 entries, not per
    1,000 objects of every version): the numbers of its version folders, and the names of the files beside them
    (`v<N>.damaged.json`: `store repair`'s markers)."""
    remote.fs.invalidate_cache()
    try:
        entries = remote.fs.ls(remote.path(table), detail=True)
    except FileNotFoundError as e:
        if no_bucket(e):
            raise
        return [], set()
    numbers, beside = [], set()
    for entry in entries:
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if entry.get("type") != "directory":
            beside.add(name)
        elif m := fmt.VERSION_RE.fullmatch(name):
            numbers.append(int(m.group(1)))
    return sorted(numbers), beside


def _judged(remote, base: str, want: dict, world: int, same: Callable[[Any], bool] | None) -> tuple[bool, bool]:
    """(resumable, adoptable) of the version folder `base` for `world` ranks writing schema `want`: resumable, a
    part of this very run, when its schema.json is `want`, its world-size.json `world` ranks and its manifest is not
    there (a folder holding nothing is no version: resumable too); adoptable when complete and `same` (None: never)
    accepts its schema.json. Its schema.json read (a GET), and only when it may be resumed or adopted its manifest
    looked up (a HEAD) and its world-size.json read."""
    schema, there = _schema_of(remote, base)
    if not there and not _holds_objects(remote, base):
        return True, False
    serves = same is not None and same(schema)
    if schema != want and not serves:
        return False, False
    complete = remote.exists(f"{base}/{fmt.MANIFEST}")
    if complete or schema != want:
        return False, complete and serves
    try:
        return _world_of(remote.read(f"{base}/{WORLD_JSON}", small=True)) == world, False
    except FileNotFoundError:
        return False, False


def _holds_objects(remote, base: str) -> bool:
    """Does the folder `base` hold any object? On S3 a listed folder does (it is its objects' common prefix); a
    file system keeps empty folders (a gc removed their files), listed here."""
    return remote.is_s3 or bool(remote.listing(base))


def _candidates(table: str, numbers: list[int], beside: set[str], current: int) -> list[int]:
    """The versions, newest first, that a run may adopt if complete and of its schema: not `current`, and not
    retired by `store repair` (its marker beside them)."""
    from store.remote_sync import marker_rel

    return [v for v in sorted(numbers, reverse=True)
            if v != current and marker_rel(table, v).rsplit("/", 1)[1] not in beside]


def _current_of(remote, table: str) -> int:
    """The remote's current version of `table` (0: none)."""
    from store.remote_sync import _parse_record

    try:
        entry = _parse_record(remote.read(fmt.STORE_JSON, small=True), remote.url)["tables"].get(table)
    except FileNotFoundError:  # the first commit of the store lost its swap
        entry = None
    return 0 if entry is None else int(entry["current"])


def _newest_committed(remote, table: str, candidates: list[int], same: Callable[[Any], bool]) -> int:
    """The first of `candidates` (newest first) that is complete and whose schema.json (parsed, None when missing
    or unreadable) `same` accepts; 0: none. Looked at 16 at a time, in order; none started past the one found."""
    def serves(v: int) -> bool:
        base = f"{table}/v{v}"
        return remote.exists(f"{base}/{fmt.MANIFEST}") and same(_schema_of(remote, base)[0])

    found = each_at_once(serves, candidates)
    try:
        return next((v for v, ok in zip(candidates, found) if ok), 0)
    finally:
        found.close()  # the lookups still running are not waited for


def _schema_of(remote, base: str) -> tuple[Any, bool]:
    """The version folder's schema.json, parsed (None when unreadable), and whether it is there."""
    try:
        return _json_of(remote.read(f"{base}/{fmt.SCHEMA_JSON}", small=True)), True
    except FileNotFoundError:
        return None, False


def adopt_version(store: "Store", table: str, version: int, on_remote: bool = True) -> int | None:
    """A rerun reusing `version`, the complete version of its settings: make it current, as a local store's rerun
    does (a run killed after its manifest, before the store.json switch, left it not current, or another run's
    settings replaced it since). In a store URL's cache, a copy of the remote's version (`is_lazy`) is made current
    on the remote too (`on_remote`: on the one rank that may), over the current one the cache was opened with: the
    push after it never moves the remote's current back, so the run said `version` while the remote kept the other.
    Returns the higher version another writer made current meanwhile, which stays current (None: `version` is)."""
    from store.remote_shards import is_lazy

    before = store.tables().get(table)
    store.set_current(table, version)
    url = source_url(store.root)
    if not on_remote or version == before or url is None or not is_lazy(store.version_dir(table, version)):
        return None  # one this cache wrote and never pushed: the push after it sends it (current by push's rule)
    with remote_errors(url, f"making table '{table}' v{version} current"):
        current = make_current(open_remote(url), table, version, before)
    return current if current != version else None


def serving_schemas(want: dict, serving: list[dict]) -> Callable[[Any], bool]:
    """`on_remote`'s `same` for a schema `want` also served by versions of the lineages `serving` (`Lineage.to_dict`:
    settings that only add columns, as `Store.find_version`'s)."""
    return lambda schema: schema == want or (isinstance(schema, dict) and schema.get("lineage") in serving)


def open_committed(root: Path, table: str, same: Callable[[Any], bool]) -> int | None:
    """In a store URL's cache `root`, which opens only the remote's current versions (a new machine, an emptied
    cache): the newest complete version of `table` on the remote, other than its current one, whose schema.json
    `same` accepts and that `store repair` did not retire (`committed_on_remote`: its version folders listed, then
    looked up), opened in the cache lazily (its metadata) for the caller's own look (`Store.find_version`) to find
    it, and `adopt_version` to make it current, on the remote too. Its number; None when there is none or `root` is
    no cache."""
    from store.remote_cache import open_beside

    url = source_url(root)
    if url is None:
        return None
    found = committed_on_remote(url, table, same)
    if not found:
        return None
    open_beside(root, table, found)
    return found


def manifest_keys(url: str, table: str, version: int):
    """The key column of the remote's complete version `version` of `table`: its manifest, checked against the
    version's sealed checksums.json (a damaged one is a UserError, never keys read from damaged bytes)."""
    from store.checksum import crc_hex
    from store.remote_sync import version_files

    remote, base = open_remote(url), f"{table}/v{version}"
    with remote_errors(url, f"reading table '{table}' v{version}'s manifest"):
        record = remote.read(f"{base}/{fmt.CHECKSUMS}", small=True)
        entry = version_files(record, f"{url}/{base}/{fmt.CHECKSUMS}")[fmt.MANIFEST]
        data = remote.read(f"{base}/{fmt.MANIFEST}")
    if (len(data), crc_hex(data)) != (int(entry["nbytes"]), entry["crc32c"]):
        raise UserError(f"{url}/{base}/{fmt.MANIFEST} is damaged ({len(data)} bytes, crc32c {crc_hex(data)}; "
                        f"{fmt.CHECKSUMS} records {entry['nbytes']} bytes, crc32c {entry['crc32c']})")
    return pq.read_table(pa.BufferReader(data), columns=["key"]).column("key")


def remote_quarantine(url: str):
    """The rows of the remote's quarantine.parquet (none when it has none); a damaged one is refused in one line,
    as a cache's open refuses it (store/remote_pull.pull_quarantine)."""
    from store import quarantine
    from store.remote_sync import damaged_quarantine

    with remote_errors(url, f"reading {fmt.QUARANTINE}"):
        try:
            data = open_remote(url).read(fmt.QUARANTINE, small=True)
        except FileNotFoundError:
            return quarantine.empty()
    rows, why = quarantine.parsed(data)
    if rows is None:
        raise damaged_quarantine(url, why)
    return rows


def _rows(remote, rel: str) -> int:
    """A manifest's row count, from its footer (a few range reads, not the whole manifest)."""
    with remote.fs.open(remote.path(rel), "rb") as f:
        return pq.ParquetFile(f).metadata.num_rows


def _json_of(data: bytes):
    try:
        return json.loads(data)
    except ValueError:
        return None


def _world_of(data: bytes) -> int | None:
    record = _json_of(data)
    return record.get("world_size") if isinstance(record, dict) else None


def drop_local_version(writer: TableWriter) -> None:
    """After the remote commit: this node's cached folder of the version goes (it holds only this node's shards)."""
    drop_part(writer.store.root, writer.table, writer.version)


def drop_part(root: Path, table: str, version: int, schema: dict[str, Any] | None = None) -> None:
    """This node's in-progress folder of a version the remote holds complete; renamed first, so an opening reader
    never sees it half-deleted. `schema`: only a folder of that schema (another run's part is not this one to
    drop; the next open that finds its number complete on the remote sets it aside)."""
    vdir = fmt.version_dir(root, table, version)
    with fmt.flock(root / fmt.STORE_LOCK):
        if not vdir.is_dir():
            return  # another rank of this node dropped it
        if schema is not None and (fmt.is_complete(vdir) or not (vdir / fmt.SCHEMA_JSON).is_file()
                                   or fmt.read_json(vdir / fmt.SCHEMA_JSON, "schema.json") != schema):
            return
        doomed = vdir.with_name(f".{vdir.name}.dropped")
        shutil.rmtree(doomed, ignore_errors=True)
        try:
            vdir.rename(doomed)
        except FileNotFoundError:  # set aside meanwhile by an open (store/remote_shards.py, under the cache lock)
            return
    shutil.rmtree(doomed, ignore_errors=True)


def push_node_quarantine(root: Path, url: str, table: str) -> None:
    """This node's quarantine rows (its cache `root`'s `quarantine.parquet`: what its ranks rejected) merged into
    the remote's, as push merges them (store/remote_push.push_quarantine)."""
    from store.remote_push import push_quarantine

    with remote_errors(url, f"this node's quarantine rows of table '{table}'"):
        push_quarantine(open_remote(url), root)


def check_node_quarantine(writer: TableWriter) -> None:
    """Before rank 0's commit (every node, all ranks agreeing): the remote's quarantine.parquet can take this
    node's rows. A damaged one refused after the commit left the version committed and the rows unmerged."""
    from store.remote_push import check_quarantine

    url = str(writer.remote_url)
    with remote_errors(url, f"the quarantine rows of table '{writer.table}' v{writer.version}"):
        check_quarantine(open_remote(url), writer.store.root)
