"""Reading a version's shard files: an LRU of open descriptors (maps for scanned shards), sample bytes by pread
or from a scan's map. Part of the reader (store/reader.py); one `ShardFiles` per thread (the LRU is not
thread-safe: the check-ahead thread has its own, pread only). In a lazily cached version of a store at a URL
(store/remote_shards.py) a shard not there yet is fetched on this miss: whole for a scan, its sample's byte
range for a random read. Every read first checks that no read lease of the process was lost (store/lease.py: a
process paused past its lease's margin may have had its version removed by a `store gc` meanwhile).
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from store import integrity
from store.integrity import DamagedData
from store.lease import check_held

DEFAULT_MAX_OPEN_SHARDS = 256  # shard files kept open per reader (LRU); the kernel allows ~65k maps a process
SCAN_RUN = 3  # this many reads in a row from one shard make it a scan: the shard is mapped (random reads pread)


def lost_file(vdir: Path, shard: str) -> DamagedData:
    """A shard that was there when the reader opened and is gone now: one line, no traceback."""
    return DamagedData(f"{integrity.where(vdir)}: shard {shard} disappeared while it was being read (the version "
                       "was moved aside or deleted under a running reader, e.g. by `pipeline store repair` or "
                       "by hand); rerun the command, or resume the training, to read the current version")


class NotCached(Exception):
    """A shard of a lazily cached version that cannot be cached whole now (evicted by another process just before
    this open and no room left, or damaged on the server): its samples are read by range instead."""


class ShardFiles:
    """Shard files of one version folder, at most `max_open` open at once (least recently used closed first): a
    million-sample store has tens of thousands of shards. `scans=False`: never maps (every read is a pread)."""

    def __init__(self, vdir: Path, max_open: int = DEFAULT_MAX_OPEN_SHARDS, scans: bool = True) -> None:
        self.dir, self._dir_str = vdir, str(vdir)
        self._real = os.path.realpath(vdir)  # which lost read lease stops these reads (`check_held`)
        self.max_open, self.scans = max(1, int(max_open)), scans
        self._open: OrderedDict[str, int | mmap.mmap] = OrderedDict()  # shard -> descriptor, or map when scanned
        self._run: tuple[str | None, int] = (None, 0)  # (shard of the last reads, how many in a row)
        self._carried = False  # the current shard's reads continue a scan of the previous one (lazy versions)
        from store.remote_shards import fetcher_for

        self._fetcher = fetcher_for(vdir)  # None unless a lazily cached version (one stat here, none per read)

    def _os_open(self, shard: str) -> int:
        path = os.path.join(self._dir_str, shard)  # os.path: cheaper than pathlib
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            if self._fetcher is None:
                raise lost_file(self.dir, shard) from None
            problem = self._fetcher.fetch_whole(shard)  # not cached yet, or evicted since
            if problem is not None:
                raise NotCached(problem) from None
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # another process of the node evicted it right after the fetch
                raise NotCached("evicted by another process right after its fetch") from None
        if self._fetcher is not None:
            self._fetcher.touch(fd)  # its last use, for the cache's LRU eviction
        return fd

    def _handle(self, shard: str) -> int | mmap.mmap:
        h = self._open.get(shard)
        if h is not None:
            self._open.move_to_end(shard)
            return h
        h = self._os_open(shard)
        self._open[shard] = h
        while len(self._open) > self.max_open:
            _, old = self._open.popitem(last=False)
            _close(old)
        return h

    def map(self, shard: str) -> mmap.mmap:
        """Private (copy-on-write) map: tensors are writable views, and a write never reaches the file."""
        h = self._handle(shard)
        if isinstance(h, int):
            try:
                m = mmap.mmap(h, 0, access=mmap.ACCESS_COPY)  # the map keeps its own duplicate of the descriptor
            finally:
                os.close(h)
                del self._open[shard]
            self._open[shard] = h = m
        return h

    def pread(self, shard: str, start: int, n: int) -> np.ndarray | str:
        """The n bytes at `start` in a fresh buffer of their own, or what is wrong (the file is short)."""
        check_held(path=self._real)  # a lease lost while the process was paused: its files may be gone, or a mix
        if (self._fetcher is not None and shard not in self._open
                and not os.path.exists(os.path.join(self._dir_str, shard))):
            got = self._fetch(shard, start, n)
            if got is not None:
                return _whole(got, n)
        try:
            return self._pread_file(shard, start, n)
        except NotCached:  # gone between the check and the open, and not fetched whole again: by range
            got = self._fetcher.read(shard, start, n, keep=not self.scans)
            return self._pread_file(shard, start, n) if got is None else _whole(got, n)

    def _pread_file(self, shard: str, start: int, n: int) -> np.ndarray | str:
        h = self._handle(shard)
        buf = np.empty(n, np.uint8)
        if isinstance(h, int):
            got = os.preadv(h, [buf], start)
        else:  # mapped by an earlier scan (the map keeps no descriptor we can use): read like any random read
            fd = self._os_open(shard)
            try:
                got = os.preadv(fd, [buf], start)
            finally:
                os.close(fd)
        if got != n:
            return f"the shard ends {n - got} bytes before the sample does"
        return buf

    def _scanning(self, shard: str) -> bool:
        """Count a read from `shard`; True when it belongs to a scan: the `SCAN_RUN`-th or later read in a row
        from one shard, or - in a lazily cached version, where each read before that fetches a byte range - any
        read of a shard whose first read came right after a full run on the one before (a scan goes on from shard
        to shard)."""
        last, count = self._run
        if shard != last:
            self._carried = self._fetcher is not None and count >= SCAN_RUN
            count = 0
        self._run = (shard, count + 1)
        return count + 1 >= SCAN_RUN or self._carried

    def _fetch(self, shard: str, start: int, n: int) -> np.ndarray | None:
        """A shard not cached: only these bytes from the remote, or None once it is cached whole. The check-ahead
        thread (scans=False) reads in the consumer's order: its third read in a row from one shard fetches the
        shard whole, ahead of the consumer's scan; the ranges it fetches are kept for the consumer's reads."""
        if not self.scans and self._scanning(shard) and self._fetcher.fetch_whole(shard, wait=False) is None:
            return None
        return self._fetcher.read(shard, start, n, keep=not self.scans)

    def sample(self, shard: str, start: int, n: int) -> tuple[Any, int] | str:
        """(buffer, where shard offset 0 lies in it), or what is wrong. The `SCAN_RUN`-th and later reads in a row
        from one shard (a scan) come from the shard's map (zero-copy views, the kernel's readahead); any other
        read is one pread of the sample's bytes into a fresh buffer that only this sample's tensors reference
        (never reused). A random read in a million-sample store hits one shard of ~20k, so a map would be set up
        and torn down for a single sample, and one large read is what a cold disk serves best."""
        check_held(path=self._real)
        if self.scans and self._scanning(shard) and (
                self._fetcher is None or self._fetcher.fetch_whole(shard) is None):  # a scan caches whole shards
            try:
                m = self.map(shard)
            except NotCached:  # evicted by another process right after its fetch, and no room now
                m = None
            if m is not None:
                if len(m) < start + n:  # mapped after the file was cut short: its tensors would lie past the map
                    return f"the shard ends {start + n - len(m)} bytes before the sample does"
                return m, 0
        got = self.pread(shard, start, n)
        return got if isinstance(got, str) else (got, -start)

    @property
    def lazy(self) -> bool:
        """A lazily cached version of a store URL (its shards fetched on a miss)."""
        return self._fetcher is not None

    def drop_damaged_copy(self, shard: str, problem: str) -> bool:
        """In a lazily cached version, the cached file whose bytes failed a sample's check removed (closed here,
        unlinked: store/remote_shards.drop_damaged_copy); True when the sample's next read goes to the URL."""
        if self._fetcher is None:
            return False
        from store.remote_shards import drop_damaged_copy

        h = self._open.pop(shard, None)
        if h is None:  # no descriptor of the file: the bytes came from the URL by range, theirs is the damage
            return False
        _close(h)
        return drop_damaged_copy(self.dir, shard, problem)

    def open_handles(self) -> list[int | mmap.mmap]:
        """The descriptors and maps held now (tests, bench)."""
        return list(self._open.values())

    def close(self) -> None:
        for h in self._open.values():
            _close(h)
        self._open.clear()
        self._run, self._carried = (None, 0), False


def _whole(got: np.ndarray, n: int) -> np.ndarray | str:
    return got if len(got) == n else f"the shard ends {n - len(got)} bytes before the sample does"


def _close(h: int | mmap.mmap) -> None:
    """A descriptor is closed; a map is only dropped, never closed: tensors from torch.frombuffer hold a reference
    to the map but no buffer export, so close() would unmap memory they still view (a segfault on their next
    read). The map unmaps when the last tensor viewing it goes."""
    if isinstance(h, int):
        os.close(h)
