"""Lazily cached versions of a store at a URL: metadata fetched on open, shard bytes on first need.

`open_lazily` fetches into the cache's local store folder only what a reader's open path reads of each version
(store.json, and per version every file its sealed `checksums.json` lists except the shard files: schema,
manifest, shard indexes, rank-done files), each checked against that record as `pipeline store pull` checks it,
plus a marker (`MARKER`) naming where the version lives. Then the ordinary reader (store/reader.py) opens the
folder; its shard files (store/shard_io.py) call back here, through `fetcher_for`, when a shard is not there:
- a scan (or a caller that needs the whole file: a local verify of the copy, a writer hard-linking a shard) fetches the whole shard
  to a temp name in the version folder, its size and CRC32C checked against `checksums.json` while it streams,
  and renames it into place: no torn file is ever visible under a shard name. One process of the node fetches a
  shard at a time (`FETCH_LOCK`); another's random read takes its range meanwhile. A shard that fails the check
  is not cached; its samples are then read by range, so the per-sample check names the damaged ones.
- a random read fetches only the sample's byte range (one HTTP Range GET); the reader checks those bytes against
  the sample's CRC32C on first read exactly as bytes read from a local file. Ranges are not kept on disk; once
  the ranges this node's processes read from a shard reach `WHOLE_AFTER` of its size (counted across processes:
  ranks of a node read disjoint samples of the same shards), the rest is cheaper as one GET and the shard is
  fetched whole (later epochs then read it warm).
A check-ahead thread (a pread-only `ShardFiles`) keeps the ranges it fetched for the consumer's read of the same
sample (`_memo`, bounded): the check-ahead window is then the remote prefetch, and no range is fetched twice.
Space is made before a whole fetch by evicting least recently used shards (store/remote_cache.evict, under the
cache lock); when the cache cannot make room, or its disk is full, the shard is read by range instead, never an
error mid-run.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from schemas import interruptible
from schemas.byte_bar import byte_bar
from schemas.errors import UserError
from schemas.units import size_text
from store import format as fmt
from store import remote_download
from store.checksum import RunningCrc
from store.io_errors import CACHE_FULL, DiskFullError, writing
from store.lease import process_tag
from store.remote import READ_PIECE, Remote, SharedBar, each_at_once, lost_object, open_remote, remote_errors

log = logging.getLogger("store")

# store URL -> the storage options (`-o`: an endpoint, a profile) its lazy open was given in this process, for the
# shard fetches and metadata refetches after it: they open the URL from a cached version's marker, which never
# records them (they may hold secrets). Without it they asked the environment's server.
_opened_with: dict[str, dict[str, Any]] = {}


def _open(url: str) -> Remote:
    return open_remote(url, _opened_with.get(url.rstrip("/")))

MARKER = ".remote.json"  # in a lazily cached version folder: {"url", "table", "version"} of its remote copy
LAZY_SUFFIX = ".lazy"  # `.v<N>.lazy`: a version's metadata being fetched (not a version name: readers skip it)
# `.<shard>.fetch-<pid>-<pid start time>-n<pid namespace>-<thread>` (store/lease.process_tag; `<pid>-<start>-<thread>`
# and `<pid>-<thread>` by earlier releases): a shard being fetched (counted by the cache, never read; a killed
# fetch's is evicted first)
FETCH_TAG = ".fetch-"
RANGED = FETCH_TAG + "ranged"  # `.<shard>.fetch-ranged`: bytes this node's processes read from the shard by range
FETCH_LOCK = ".fetch.lock"  # `.<shard>.fetch.lock`: held by the one process of the node fetching the shard whole
NO_ROOM = "no room in the store cache"  # `fetch_whole`'s answer when the cache limit leaves no room for the shard
DISK_FULL = "the store cache's disk is full"  # `fetch_whole`'s answer meanwhile (the error: `ShardFetcher.full`)
# After a whole fetch met a full disk, this process reads by range for this long before it tries one again: each
# try starts a GET, and the reads of a full node would each pay one for nothing.
FULL_RETRY_S = 60.0
WHOLE_AFTER = 0.5  # fraction of a shard read by range after which it is fetched whole
MEMO_BYTES = 256 * 2**20  # ranges fetched by a check-ahead thread, kept for the consumer's read


def is_lazy(vdir: Path | str) -> bool:
    return os.path.isfile(os.path.join(vdir, MARKER))


def drop_damaged_copy(vdir: Path, shard: str, problem: str) -> bool:
    """A shard file of a lazily cached version whose bytes failed a check (the cut or flipped bytes of this node's
    disk: a whole fetch is checked before its rename into place): removed, so that its samples are read again from
    the URL, the copy every node reads (also when another process of the node removed it first). Called only for
    bytes read from the file (bytes of the URL's own are its damage). Refusing it instead recorded the damage in
    the cache, whose every later run on the node refused the sample (or, with on_damaged=skip, left it out) and
    advised `store repair` of a URL that holds it intact. The node's running total keeps counting the file till
    the next walk (more than is there: never over the limit)."""
    if not is_lazy(vdir):
        return False
    try:
        os.unlink(os.path.join(vdir, shard))
    except FileNotFoundError:  # the caller saw it: another process of the node (its ranks read together) dropped it
        return True
    except OSError:  # a cache this process may not write: refused as damage, as before
        return False
    from store import integrity

    log.warning("%s: the cached copy of %s is damaged on this node (%s): removed, read again from the URL",
                integrity.where(vdir), shard, problem)
    return True


def refetch_metadata(vdir: Path) -> bool:
    """A lazily cached version whose metadata failed their check on a reader's open (this node's disk damaged the
    cached copy: the cache's open trusts a file whose size, mtime and inode are those recorded when it was fetched,
    store/remote_checked.py; or deleted it: a cleanup, a cache folder partly wiped): its checksums.json, if damaged
    or missing, and every other metadata file missing or whose bytes differ from it fetched again from the URL,
    each checked, each replacing the damaged copy in one rename (the node's other
    ranks, opening it meanwhile, never find it missing); True when the cached metadata now match the record (fixed
    here, or by another process of the node since the caller's read): the caller reads them again, once. False
    for a version that is not a cached copy, or whose record on the URL is damaged (refused as before). Refusing
    a damaged copy recorded the damage in the cache, whose every later open on the node refused the version, and
    advised `store repair` (or a rerun of the encoder) for a URL that holds it intact."""
    from store import integrity

    if not is_lazy(vdir):
        return False
    url, base = source_of(vdir)
    fixed: list[str] = []
    try:
        intact = _refetch_metadata(vdir, url, base, fixed)
    except OSError as e:
        if not e.filename:  # the remote's, as one line
            raise
        # a cache this process may not write, a full disk: the damage is refused as before (the caller's line)
        log.warning("%s: could not fetch the damaged cached metadata again (%s)", url, e)
        return False
    if fixed:
        log.warning("%s: the cached copy of %s was damaged on this node: fetched again from the URL",
                    integrity.where(vdir), ", ".join(fixed))
    return intact


def _refetch_metadata(vdir: Path, url: str, base: str, fixed: list[str]) -> bool:
    from tqdm import tqdm

    from store import integrity
    from store.checksum import SealError, file_crc, unseal
    from store.remote_pull import fetch_checked
    from store.remote_sync import _File

    with remote_errors(url, f"fetch {base}"):
        remote = _open(url)
        try:
            sums = integrity.read_version_checksums(vdir) or {}
        except integrity.DamagedData:  # damaged, or missing (a cached copy always has one)
            record = remote.read(f"{base}/{fmt.CHECKSUMS}", small=True)
            try:
                unseal(record)
            except SealError:  # the URL's own is damaged: refused as before (the caller's line)
                return False
            fmt.atomic_write_bytes(vdir / fmt.CHECKSUMS, record)
            sums = integrity.read_version_checksums(vdir) or {}
            fixed.append(fmt.CHECKSUMS)
        # the manifest last: it marks a version complete (`fmt.is_complete`), its other files there before it
        for name, entry in sorted(sorted(sums.items()), key=lambda item: item[0] == fmt.MANIFEST):
            path = vdir / name
            # missing too: the open fetched every file but the shards, so one not there was deleted on the node (a
            # cleanup, a cache folder partly wiped), not yet to be fetched
            if is_shard(name) or (path.exists() and file_crc(path) == (entry["crc32c"], entry["nbytes"])):
                continue
            # to a name of its own (`fetch_checked` would trust its record of the bytes first fetched to `path`;
            # a process tag: the node's ranks may fetch it at once), then one rename over the damaged copy
            part = vdir / f".{name}{FETCH_TAG}{process_tag()}-{threading.get_ident()}"
            fetch_checked(remote, _File(f"{base}/{name}", int(entry["nbytes"]), entry["crc32c"]), part,
                          tqdm(disable=True), part=part)
            os.replace(part, path)
            fixed.append(name)
    return True


def source_of(vdir: Path) -> tuple[str, str]:
    """(the store URL, `<table>/v<N>` there) a lazily cached version copies, from its marker; one line when the
    marker cannot be read (this node's disk damaged it: json's traceback in every reader of the node before), which
    the next open of the URL writes again (`_open_version`)."""
    try:
        source = json.loads((Path(vdir) / MARKER).read_text())
        return str(source["url"]), f"{source['table']}/v{int(source['version'])}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{Path(vdir) / MARKER} is damaged ({type(e).__name__}: {e}): it names where this cached "
                        f"version lives; rerun (the next open of the store URL writes it again), or remove "
                        f"{Path(vdir).parent.parent} (a cache)") from None


def is_cache_file(name: str) -> bool:
    """What the cache keeps beside a lazily cached version's own files (the marker, fetches in progress, the range
    counts, the fetch locks): never part of the version (verify skips them)."""
    return name == MARKER or FETCH_TAG in name or name.endswith(FETCH_LOCK)


def is_shard(name: str) -> bool:
    return fmt.SHARD_RE.fullmatch(name) is not None


_fetchers: dict[str, "ShardFetcher"] = {}
_fetchers_lock = threading.Lock()
_limits: dict[str, int] = {}  # cache folder -> size limit in bytes (set by remote_cache.local_store)


def set_limit(cache: Path, limit: int | None) -> None:
    if limit is None:
        _limits.pop(str(cache), None)
    else:
        _limits[str(cache)] = int(limit)


def fetcher_for(vdir: Path | str) -> "ShardFetcher | None":
    """The fetcher of a lazily cached version folder (one per folder and process), None for any other folder."""
    key = str(vdir)
    f = _fetchers.get(key)
    if f is not None or not is_lazy(key):
        return f
    with _fetchers_lock:
        if key not in _fetchers:
            _fetchers[key] = ShardFetcher(Path(key))
        return _fetchers[key]


def fetch_stats() -> dict[str, int]:
    """Totals over this process's fetchers (tests, bench): whole shards fetched, their bytes, ranges, their bytes."""
    out = {"shards": 0, "shard_bytes": 0, "ranges": 0, "range_bytes": 0}
    for f in list(_fetchers.values()):
        for k in out:
            out[k] += f.stats[k]
    return out


class ShardFetcher:
    """Fetches the shard files of one lazily cached version folder (thread-safe)."""

    def __init__(self, vdir: Path) -> None:
        from store import integrity

        self.vdir = vdir
        self.url, self.base = source_of(vdir)
        self.sums = integrity.read_version_checksums(vdir) or {}
        self.cache = vdir.parent.parent.parent  # <cache>/<store hash>/<table>/v<N>
        self._remote: Remote | None = None
        self._lock = threading.Lock()
        self._shard_locks: dict[str, threading.Lock] = {}
        self._ranged: dict[str, int] = {}  # shard -> bytes fetched by range so far
        self._uncacheable: dict[str, str] = {}  # shard -> why its whole fetch failed (read by range instead)
        self._whole_answers = False  # the server answered a range read with the whole object (it ignores Range)
        self.full: DiskFullError | None = None  # the last whole fetch's full disk (read by range till `_full_until`)
        self._full_until = 0.0
        self._memo: OrderedDict[tuple[str, int, int], np.ndarray] = OrderedDict()
        self._memo_bytes = 0
        self.stats = {"shards": 0, "shard_bytes": 0, "ranges": 0, "range_bytes": 0}

    @property
    def remote(self) -> Remote:
        if self._remote is None:
            self._remote = _open(self.url)
        return self._remote

    @contextmanager
    def _connection(self, action: str, shard: str | None = None) -> Iterator[None]:
        """The library's errors as one line; after one, the next fetch opens a fresh connection (a server that
        restarted is reached again, as by a new process). `shard`: the object read, named when it is lost."""
        try:
            with remote_errors(self.url, action):
                try:
                    yield
                except FileNotFoundError as e:  # a lost shard named, not "rerun" for ever (`lost_object`)
                    if shard is not None and e.filename is None and \
                            (lost := lost_object(self.remote, f"{self.base}/{shard}", e)) is not None:
                        raise lost from None
                    raise
        except BaseException:
            self._remote = None
            raise

    # ------------------------------------------------------------ whole shards

    def fetch_whole(self, shard: str, wait: bool = True) -> str | None:
        """Make the shard file present; None when it is, else why it cannot be (damaged on the server, not
        listed, no room in the cache, its disk full, or - `wait=False` - another process of the node fetching it
        now)."""
        path = self.vdir / shard
        if path.exists():
            return None
        if shard in self._uncacheable:
            return self._uncacheable[shard]
        entry = self.sums.get(shard)
        if entry is None:
            return f"shard {shard} is not listed in its version's {fmt.CHECKSUMS}"
        with self._lock:
            lock = self._shard_locks.setdefault(shard, threading.Lock())
        # polled (schemas/interruptible.py): a main thread waiting for another thread's fetch of the shard (a scan
        # while the check-ahead thread fetches it, minutes on a slow link) held a Ctrl-C another thread took
        interruptible.acquire(lock)
        with ExitStack() as node:  # one fetch per shard in this process, and in this node (below)
            node.callback(lock.release)
            # Ranks of a node read the same shards and pass `WHOLE_AFTER` together: unlocked, each downloaded the
            # shard and reserved its size (evicting shards for copies the one winning rename then dropped). A
            # flock (dropped by the kernel with a killed process) lets one fetch; a random read (wait=False) reads
            # its range meanwhile, a scan waits and then reads the file the other process put there.
            try:
                node.enter_context(fmt.flock(self.vdir / f".{shard}{FETCH_LOCK}", blocking=wait))
            except UserError:
                return f"shard {shard} is being fetched by another process"
            if path.exists():
                return None
            if time.monotonic() < self._full_until:
                return DISK_FULL
            part = self.vdir / f".{shard}{FETCH_TAG}{process_tag()}-{threading.get_ident()}"
            try:
                with writing("the store cache", self.cache, instead=CACHE_FULL):
                    reserved = self._reserve(part, int(entry["nbytes"]))  # (its running total written too)
                if not reserved:
                    return NO_ROOM  # not kept: a later read may find room
                return self._fetch_into(part, shard, entry)
            except DiskFullError as e:
                return self._disk_full(shard, e)
            finally:
                if part.exists():
                    part.unlink()

    def _fetch_into(self, part: Path, shard: str, entry: dict[str, Any]) -> str | None:
        """`fetch_whole`'s download of the shard into its reserved temp file `part`, checked, renamed into place."""
        with writing("the store cache", self.cache, instead=CACHE_FULL), \
                self._connection(f"fetch {self.base}/{shard}", shard):
            n, crc = _download(self.remote, f"{self.base}/{shard}", part)
        if (n, crc) != (int(entry["nbytes"]), entry["crc32c"]):
            problem = (f"{self.url}/{self.base}/{shard} is damaged ({n} bytes, crc32c {crc}; "
                       f"{fmt.CHECKSUMS} records {entry['nbytes']} bytes, crc32c {entry['crc32c']})")
            self._uncacheable[shard] = problem
            log.warning("%s: not cached, its samples are read by range (each checked)", problem)
            return problem
        try:
            os.replace(part, self.vdir / shard)  # atomic: readers see the whole checked file or none
        except FileNotFoundError:  # evicted as a killed fetch's (paused past the margin): read by range
            return f"shard {shard}'s fetch was taken for a killed one's and its temp file removed"
        Path(self.vdir / f".{shard}{RANGED}").unlink(missing_ok=True)  # cached whole: no count needed
        self.stats["shards"] += 1
        self.stats["shard_bytes"] += n
        return None

    def _disk_full(self, shard: str, e: DiskFullError) -> str:
        """A whole fetch met a full disk (filled by other files than the cache's: its limit counts only its own):
        the reads go on by range, as when the limit leaves no room (a node's full disk stopped every rank of the job
        mid-run, and its rerun met the same disk); said once per full spell. A whole open re-raises `self.full`."""
        if time.monotonic() >= self._full_until + FULL_RETRY_S:  # not said in the spell just before
            log.warning("%s/%s/%s: not cached, the disk of the store cache %s is full: its samples, and those of "
                        "the other shards not cached, are read by byte range meanwhile (slower); free space there",
                        self.url, self.base, shard, self.cache)
        self.full, self._full_until = e, time.monotonic() + FULL_RETRY_S
        return DISK_FULL

    def _reserve(self, part: Path, nbytes: int) -> bool:
        """Under the cache lock: evict least recently used shards until `nbytes` more fit under the limit, then
        create `part` at its full size so that other processes count it. Without a limit: `nbytes` added to the node's
        running total, `part` created at full size all the same. False when it cannot fit."""
        from store.remote_cache import CACHE_LOCK, add_usage, make_room

        limit = _limits.get(str(self.cache))
        with fmt.flock(self.cache / CACHE_LOCK):
            if limit is None:  # no limit here, but a limited process of the node may share the cache: it counts them
                add_usage(self.cache, nbytes)
            elif not make_room(self.cache, limit, nbytes):
                return False
            # at its full size either way: a walk meanwhile sets the total to what it counts on disk
            with open(part, "wb") as f:
                f.truncate(nbytes)
        return True

    def touch(self, fd: int) -> None:
        """A shard opened for reading: its last use, for LRU eviction."""
        try:
            os.utime(fd)
        except OSError:
            pass

    # ------------------------------------------------------------ byte ranges

    def read(self, shard: str, start: int, n: int, keep: bool = False) -> np.ndarray | None:
        """Sample bytes [start, start + n) of a shard not cached: a range fetched now (or kept by the check-ahead
        thread), or None when the shard has just been fetched whole (read it from its file). `keep`: the caller
        is the check-ahead thread; the consumer's read of the same bytes takes them from memory."""
        key = (shard, start, n)
        with self._lock:
            got = self._memo.pop(key, None)
            if got is not None:
                self._memo_bytes -= n
                return got
            ranged = self._ranged.get(shard, 0) + n
            self._ranged[shard] = ranged
            fetching = self._shard_locks.get(shard)
        ranged = max(ranged, self._node_ranged(shard, n))
        if fetching is not None and fetching.locked():  # another thread fetches it whole (a scan): wait for it
            interruptible.acquire(fetching)
            fetching.release()
            if os.path.exists(self.vdir / shard):
                return None
        entry = self.sums.get(shard)
        # a server that ignores Range sends the whole object for every range: fetched whole once, into the cache
        whole_first = self._whole_answers or (entry is not None and ranged >= WHOLE_AFTER * int(entry["nbytes"]))
        if entry is not None and shard not in self._uncacheable and whole_first and \
                self.fetch_whole(shard, wait=False) is None:
            return None
        with self._connection(f"read {self.base}/{shard}", shard):
            try:
                data = self.remote.fs.cat_file(self.remote.path(f"{self.base}/{shard}"),
                                                start=start, end=start + n)  # an HTTP Range GET
            except OSError as e:
                if not past_the_end(e):
                    raise
                # the object ends before the sample starts (cut short on the server): no bytes, which the sample's
                # check names as damaged, as any short read (before: "answered ...; rerun", failing for ever)
                data = b""
        if len(data) > n:
            data = self._asked_bytes(shard, start, n, data)
        buf = np.frombuffer(bytearray(data), np.uint8)  # writable, as a pread buffer
        with self._lock:
            self.stats["ranges"] += 1
            self.stats["range_bytes"] += len(buf)
            if keep:
                self._memo[key] = buf
                self._memo_bytes += n
                while self._memo_bytes > MEMO_BYTES and self._memo:
                    (_, _, m), _ = self._memo.popitem(last=False)
                    self._memo_bytes -= m
        return buf

    def _asked_bytes(self, shard: str, start: int, n: int, data: bytes) -> bytes:
        """Bytes [start, start + n) out of an answer longer than asked: a server or proxy that ignores Range (some
        S3-compatible servers do) sends the whole object with a 200, which the sample's check took for a damaged
        shard ("ends -N bytes before the sample does"). The whole object (its recorded size) is sliced, and later
        reads fetch each shard whole into the cache first; any other length is refused in one line."""
        entry = self.sums.get(shard)
        if entry is None or len(data) != int(entry["nbytes"]):
            raise UserError(f"{self.url}/{self.base}/{shard}: a read of bytes [{start}, {start + n}) got {len(data)} "
                            "bytes, neither those nor the whole object: the server (or a proxy) does not honour Range "
                            f"reads; copy the store with `pipeline store pull {self.url} DIR` and read the copy")
        if not self._whole_answers:
            log.warning("%s ignores Range reads (the whole object came for a sample's bytes): shards are fetched whole "
                        "into the cache instead", self.url)
            self._whole_answers = True
        return data[start:start + n]

    def _node_ranged(self, shard: str, n: int) -> int:
        """Add `n` to the bytes this node's processes have read from `shard` by range; their total. Ranks of one
        node read disjoint samples of the same shards (each about 1/ranks of a shard per epoch), so a count per
        process would never reach `WHOLE_AFTER` and every epoch would fetch its ranges again; the node's count
        caches the shard whole once the node has read half of it. Appends of 8 bytes (O_APPEND: whole records
        from every process); 0 when the cache cannot be written (the process's own count decides)."""
        path = os.path.join(self.vdir, f".{shard}{RANGED}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, int(n).to_bytes(8, "little"))
            finally:
                os.close(fd)
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return 0
        return int(np.frombuffer(data[: len(data) // 8 * 8], "<i8").sum())


def past_the_end(e: BaseException | None) -> bool:
    """Is this S3's answer to a Range that starts past the object's end (416 InvalidRange; s3fs raises it as
    OSError EINVAL, the server's answer its cause)?"""
    while e is not None:
        answer = getattr(e, "response", None)
        if isinstance(answer, dict) and ((answer.get("Error") or {}).get("Code") == "InvalidRange" or
                                         (answer.get("ResponseMetadata") or {}).get("HTTPStatusCode") == 416):
            return True
        e = e.__cause__
    return False


def _download(remote: Remote, rel: str, part: Path) -> tuple[int, str]:
    """Stream one object into `part` (created, maybe at its reserved size); (bytes written, their CRC32C). The one
    streamed-GET path of pull and verify (store/remote_download.py: one GET, a cut body resumed by a Range GET
    If-Match its ETag); s3fs's file object cost a GET per 8 MiB block and held the block."""
    crc, n = RunningCrc(), 0
    with open(part, "r+b") as dst:
        for chunk in remote_download.pieces(remote.fs, remote.path(rel), READ_PIECE, remote.is_s3):
            dst.write(chunk)
            crc.update(chunk)
            n += len(chunk)
        dst.truncate(n)
    return n, crc.hex()


def fetch_all(root: Path, versions: set[tuple[str, int]]) -> None:
    """Every shard of the lazily cached `versions` of the cached store `root` not in the cache, fetched whole and
    checked (`fetch_whole`, several at a time): a whole open (`local_store(..., whole=True)`). Called without the
    cache lock: each fetch takes it only to reserve its bytes (the limit's accounting, eviction first), and
    downloads to its own temp name beside the shard, so the node's other readers fetch and open meanwhile. A shard
    that cannot be fetched (damaged on the server, no room under the limit) is one UserError."""
    todo = [(f, shard) for t, v in sorted(versions) if (f := fetcher_for(fmt.version_dir(root, t, v))) is not None
            for shard in sorted(f.sums) if is_shard(shard) and not (f.vdir / shard).exists()]
    if not todo:
        return
    with byte_bar(sum(int(f.sums[shard]["nbytes"]) for f, shard in todo), f"pull {todo[0][0].url}") as progress:
        bar = SharedBar(progress)

        def fetch(item: tuple[ShardFetcher, str]) -> None:
            f, shard = item
            problem = f.fetch_whole(shard)
            if problem == NO_ROOM:
                from store.remote_cache import limit_text

                limit = _limits.get(str(f.cache), 0)
                raise UserError(f"the store cache {f.cache} has no room for {f.base}/{shard} "
                                f"({size_text(int(f.sums[shard]['nbytes']))}) under its limit of {limit_text(limit)}; "
                                "raise the limit (--cache-gb) or use a bigger --cache-dir")
            if problem == DISK_FULL and f.full is not None:
                raise f.full
            if problem is not None:
                raise UserError(f"{f.vdir / shard}: cannot be fetched ({problem}); rerun, or repair the store at "
                                f"{f.url}")
            bar.update(int(f.sums[shard]["nbytes"]))

        for _ in each_at_once(fetch, todo):
            pass


def fetch_problem(path: Path) -> str | None:
    """A file of a lazily cached version not in the cache (not fetched yet, or evicted since) is fetched whole and
    checked; what the fetch could not do, else None (also for any other folder's file). A full disk is raised (its
    one line): verify and repair need the whole file, and would report it as the store's damage."""
    f = fetcher_for(path.parent)
    if f is None or path.exists():
        return None
    if (problem := f.fetch_whole(path.name)) == DISK_FULL and f.full is not None:
        raise f.full
    return problem


def ensure_local(path: Path) -> Path:
    """A caller about to hard-link or open a whole shard file itself: fetched first when its version is lazily
    cached."""
    if (problem := fetch_problem(path)) is not None:
        raise UserError(f"{path}: cannot be fetched ({problem}); rerun, or repair the store at "
                        f"{fetcher_for(path.parent).url}")
    return path


# ---------------------------------------------------------------- open: metadata only


def open_lazily(url: str, root: Path, storage_options: dict[str, Any] | None, tables: list[str] | None,
                optional: tuple[str, ...] = (), skip: Callable[[str, int], bool] | None = None,
                damaged_ok: bool = False) -> set[tuple[str, int]]:
    """Make `root` a local store holding, lazily, the current versions of `tables` at `url` (`tables=None`: every
    complete version there, but those `skip` names); the (table, version) pairs it holds for the caller. A version cached already is
    checked against the remote's record (one GET of its checksums.json; a different one under the same number is
    refused); a warm open lists nothing. `damaged_ok`: repair's working copy (a damaged quarantine.parquet is
    copied for repair to set aside, store/remote_pull.pull_quarantine)."""
    from store.remote_pull import pull_quarantine, wanted_versions
    from store.remote_sync import _parse_record
    from store.store import Store

    remote = open_remote(url, storage_options)
    if storage_options:
        _opened_with[url.rstrip("/")] = dict(storage_options)
    else:  # a later open without options reads by the environment, as `open_remote` does
        _opened_with.pop(url.rstrip("/"), None)
    with remote_errors(url, "open"):
        try:
            rec = _parse_record(remote.read(fmt.STORE_JSON, small=True), url)
        except FileNotFoundError:
            rec = None
        # tables=None (repair's working copy): every complete version not retired; else the current ones (a warm
        # open lists nothing)
        listing = remote.listing() if tables is None else None
        rec, tables, wanted = wanted_versions(rec, url, tables, optional, listing)
        _renew_damaged_record(root)
        store = Store(root)
        fetched = False
        wanted = {(t, v) for t, v in wanted if skip is None or not skip(t, v)}
        for t, v in sorted(wanted):
            fetched = _open_version(remote, root, t, v) or fetched
        # older parts left in this cache whose numbers the remote holds complete (e.g. of a commit whose store.json
        # swap was lost, which a rerun with other settings did not adopt): one request per in-progress folder there
        for t in sorted({t for t, _ in wanted}):
            newest = max(v for table, v in wanted if table == t)
            for old in fmt.list_versions(root, t):
                vdir = fmt.version_dir(root, t, old)
                if old < newest and not fmt.is_complete(vdir) and remote.exists(f"{t}/v{old}/{fmt.MANIFEST}"):
                    _set_aside_if_dead(root, t, vdir)
        if fetched:
            pull_quarantine(remote, root, damaged_ok)  # the rows other stages and nodes added there (a merge)
        for t, entry in sorted(rec["tables"].items()):
            if (tables is None or t in tables) and fmt.is_complete(fmt.version_dir(root, t, int(entry["current"]))):
                store.set_current(t, int(entry["current"]))
    return wanted


def _renew_damaged_record(root: Path) -> None:
    """The cached store's store.json damaged on this node's disk: replaced by a fresh record, in which the open then
    makes the URL's current versions current (what it records is the URL's, set again by every open; a table
    committed only here and never pushed loses its entry, and its writer's rerun adopts its version by lineage).
    Before, every open on the node said to run `pipeline store repair` on the cache folder, which is refused there."""
    from schemas.newer import WrittenByNewer

    if not (root / fmt.STORE_JSON).is_file():
        return
    try:
        fmt.read_store_record(root)
    except WrittenByNewer:  # a newer release's cache: never rewritten
        raise
    except UserError:
        log.warning("%s is damaged on this node (a copy of the store URL's record): written again",
                    root / fmt.STORE_JSON)
        with fmt.flock(root / fmt.STORE_LOCK):
            fmt.write_store_record(root, fmt.new_store_record())


def open_version(url: str, root: Path, table: str, version: int,
                 storage_options: dict[str, Any] | None = None) -> None:
    """One complete version of `url` into its cached store `root`, lazily, as `open_lazily` opens the current ones
    (call under the cache lock); not made current: a rerun adopting an older version of its settings does that
    (stages/resize/earlier_versions.py)."""
    remote = open_remote(url, storage_options)
    with remote_errors(url, "open"):
        _open_version(remote, root, table, version)


def _open_version(remote: Remote, root: Path, table: str, version: int) -> bool:
    """The version's metadata fetched and checked into `root` unless cached already (then checked to be the
    remote's: one GET of its checksums.json); whether it was fetched."""
    from store.remote_checked import known_crc
    from store.remote_pull import _read_checksums
    from store.remote_sync import version_files, _conflict, _ordered

    where = f"{remote.url}/{table}/v{version}/{fmt.CHECKSUMS}"
    record = _read_checksums(remote, table, version)  # a lost one named, not "rerun" for ever
    files = _ordered(table, version, version_files(record, where), record)
    vdir = fmt.version_dir(root, table, version)
    if vdir.exists() and not fmt.is_complete(vdir):
        _set_aside_if_dead(root, table, vdir)  # a dead writer's folder, its number committed on the remote since
    if vdir.exists():
        if not fmt.is_complete(vdir) or known_crc(vdir / fmt.MANIFEST)[0] != files[-1].crc:
            raise _conflict(table, version, remote.url, root)
        _mark_again_if_damaged(vdir, remote.url, table, version)
        return False
    _fetch_metadata(remote, root, table, version, files)
    return True


def _mark_again_if_damaged(vdir: Path, url: str, table: str, version: int) -> None:
    """A cached copy of the URL's version (its manifest just checked to be the URL's) whose marker cannot be read
    (this node's disk): written again, so its readers find where it lives. `pushed_here` is not known any more:
    left out, which only keeps an older version this cache committed (`remote_cache._not_kept_here`)."""
    if not is_lazy(vdir):
        return
    try:
        source_of(vdir)
    except UserError:
        log.warning("%s: damaged on this node: written again", vdir / MARKER)
        mark(vdir, url, table, version)


def _set_aside_if_dead(root: Path, table: str, vdir: Path) -> None:
    """A version folder without a manifest in the cache, whose number the remote holds complete: the part of a
    multi-node encode killed between the remote commit and dropping it (all of it is on the remote:
    store/remote_parts.py), or a killed writer whose number another writer took since (it can never be committed,
    and the cache limit counts it, never evicting a writer's version in progress). Unless a live writer of this
    node holds one of the table's writer locks (then the caller reports the conflict), it is renamed out of the
    version names (as eviction does) and removed, with every writer lock held, and the remote's version is opened
    in its place."""
    import shutil
    from contextlib import ExitStack

    with ExitStack() as held:
        for lock in sorted((root / table).glob(".write-r*.lock")):
            try:
                held.enter_context(fmt.flock(lock, blocking=False))
            except UserError:  # a live writer
                return
        doomed = vdir.with_name(f".{vdir.name}.stale-{os.getpid()}")
        os.rename(vdir, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _fetch_metadata(remote: Remote, root: Path, table: str, version: int, files) -> None:
    """A version's files except its shards into `.v<N>.lazy/`, each checked, the marker, and the rename to `v<N>`:
    the local commit, as pull's. Fetched several at a time (`each_at_once`; the rename, not the order, is the
    commit)."""
    from store.remote_pull import fetch_checked

    final = fmt.version_dir(root, table, version)
    tmp = final.with_name(f".{final.name}{LAZY_SUFFIX}")
    tmp.mkdir(parents=True, exist_ok=True)
    todo = [f for f in files if not is_shard(f.rel.rsplit("/", 1)[1])]
    with byte_bar(sum(f.nbytes for f in todo), f"open {remote.url}/{table}/v{version}",
                  disable=len(todo) < 100) as progress:
        bar = SharedBar(progress)
        for _ in each_at_once(lambda f: fetch_checked(remote, f, tmp / f.rel.rsplit("/", 1)[1], bar), todo):
            pass
    mark(tmp, remote.url, table, version)
    os.rename(tmp, final)


def mark_copies(url: str, root: Path, storage_options: dict[str, Any] | None = None) -> None:
    """Mark the complete, unmarked versions of the cached store `root` that `url` holds identical (its manifest
    there, with the same CRC32C) as copies of the remote's, so that eviction may take them: versions pulled whole
    into a cache by earlier versions of this code, or pushed by a push_back killed before it marked them. A version
    a writer committed here and never pushed stays unmarked (store/remote_cache.py never evicts it). Two requests
    per unmarked version, while there are any."""
    from store.remote_checked import known_crc
    from store.remote_sync import version_files

    unmarked = [(t.name, v) for t in sorted(root.iterdir()) if t.is_dir() and not t.name.startswith(".")
                for v in fmt.list_versions(root, t.name)
                if fmt.is_complete(fmt.version_dir(root, t.name, v)) and not is_lazy(fmt.version_dir(root, t.name, v))]
    if not unmarked:
        return
    remote = open_remote(url, storage_options)
    with remote_errors(url, "open"):
        for t, v in unmarked:
            vdir = fmt.version_dir(root, t, v)
            try:
                rel = f"{t}/v{v}/{fmt.CHECKSUMS}"
                there = version_files(remote.read(rel, small=True), f"{url}/{rel}")
            except (FileNotFoundError, UserError):  # not pushed; or damaged there: not a copy to refetch from
                continue
            if there[fmt.MANIFEST]["crc32c"] == known_crc(vdir / fmt.MANIFEST)[0] and \
                    remote.exists(f"{t}/v{v}/{fmt.MANIFEST}"):  # checksums.json goes first: complete only with it
                mark(vdir, url, t, v)


def mark(vdir: Path, url: str, table: str, version: int, pushed_here: bool = False) -> None:
    """Mark a version folder as a cached copy of `url`'s: its missing shards are fetched, its shards evictable.
    `pushed_here`: committed in this cache and sent by its push (store/remote_cache.py `push_back`)."""
    fmt.atomic_write_json(vdir / MARKER, {"url": url, "table": table, "version": version,
                                          "cached_at": time.time(), **({"pushed_here": True} if pushed_here else {})})
