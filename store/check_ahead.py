"""Check-ahead: a reader's samples verified by a background thread a bounded window ahead of the consumer.

The CRC32C of a sample's bytes costs about as much as copying them out of the page cache (both ~15 GB/s on one
core), so checking inline on first read doubles the time of a warm read. The consumer's read order is known in
advance (train's epoch plan, evaluate's list, an encoder's image order), and `crc32c` releases the GIL, so a
thread checks the next samples (read by pread, never mapped) while the consumer copies the current ones. The
guarantee stays "every sample checked before its bytes are returned": `TableReader.check_at(i)` takes this
thread's result for `i` (waiting while the thread is on `i`), and checks inline what the thread has not reached
or did not schedule. The window
(results computed but not yet taken) bounds how far the thread runs ahead: reading far ahead would only evict
the consumer's pages. Not a library: no package verifies byte ranges ahead of a consumer.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from schemas import interruptible
from store.shard_io import ShardFiles

if TYPE_CHECKING:
    from store.sample_check import SampleCheck

DEFAULT_WINDOW = 32  # samples checked ahead of the consumer
_OPEN_SHARDS = 4  # the thread's own shard descriptors (the reader's LRU is not thread-safe)


class CheckAhead:
    """One background thread checking rows in `order` (row numbers; may be endless, consumed lazily by the
    thread) with `check` (the reader's sample check), reading by pread through shard files of its own: never a
    map, so a shard cut short under the reader is a problem reported for its rows, not SIGBUS. Results wait in a
    dict until `take` hands them to the consumer; `close` stops the thread."""

    def __init__(self, check: "SampleCheck", vdir: Path, order: Iterable[int], window: int = DEFAULT_WINDOW,
                 name: str = "") -> None:
        self.check, self.vdir, self.window = check, vdir, max(1, int(window))
        self._cond = threading.Condition()
        self._results: dict[int, str | None] = {}  # row -> problem (None: intact), in the order checked
        self._busy: int | None = None  # the row being checked right now
        # the row the consumer checks itself right now (`take` found no result): the thread leaves it, else both
        # read and CRC the same bytes (a race under load)
        self._inline: int | None = None
        # Rows whose check found a problem (or failed): never marked checked, so remembered here; intact rows
        # are marked in the sample check once taken (a second set of every row would cost ~60 MB at 1M).
        self._bad: set[int] = set()
        self._stop = False
        self.checked = 0  # rows this thread checked (tests, bench)
        self._thread = threading.Thread(target=self._work, args=(iter(order),), daemon=True,
                                        name=f"check-ahead-{name}")
        self._thread.start()

    # ------------------------------------------------------------ the thread

    def _work(self, order) -> None:
        files = ShardFiles(self.vdir, _OPEN_SHARDS, scans=False)
        # An endless order (train's plan over epochs) repeats rows: once a whole table's worth of rows in a row
        # needed no check, every row the order can yield is done, and the thread ends instead of spinning.
        done_in_a_row, rows = 0, len(self.check.view)
        try:
            for i in order:
                i = int(i)
                with self._cond:
                    while len(self._results) >= self.window and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    if self.check.is_checked(i) or i in self._results or i in self._bad or i == self._inline:
                        done_in_a_row += 1
                        if done_in_a_row > rows:
                            return
                        continue
                    done_in_a_row = 0
                    self._busy = i
                try:
                    problem = self.check.problem(i, files)  # outside the lock: crc32c releases the GIL
                except Exception:  # noqa: BLE001 - e.g. a shard gone: the consumer checks inline, and reports it
                    with self._cond:
                        self._bad.add(i)
                        self._busy = None
                        self._cond.notify_all()
                    continue
                with self._cond:
                    self._results[i] = problem
                    if problem is not None:
                        self._bad.add(i)
                    self._busy = None
                    self.checked += 1
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._busy = None
                self._stop = True
                self._cond.notify_all()
            files.close()

    # ------------------------------------------------------------ the consumer

    def take(self, i: int) -> tuple[bool, str | None]:
        """(True, problem) when the thread checked row `i` (waiting while it is on it); (False, None) when it has
        not (not reached yet, not scheduled, or stopped): the caller checks inline."""
        with self._cond:  # a Ctrl-C this thread took ends the wait (a row whose shard comes slowly: a URL's fetch)
            interruptible.wait_until(self._cond, lambda: self._busy != i)
            if i not in self._results:
                self._inline = i
                return False, None
            # The consumer is at i: results the thread made before i and that were never taken are dropped (a
            # consumer that skipped them checks inline if it reads them later), so the window cannot clog.
            for k in list(self._results):
                problem = self._results.pop(k)
                if k == i:
                    break
            self._cond.notify_all()
            return True, problem

    def damaged(self, i: int) -> None:
        """The consumer found row `i` damaged itself: the thread never checks it again (an endless order repeats
        it; an intact row is marked checked in the sample check instead)."""
        with self._cond:
            self._bad.add(i)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            interruptible.join(self._thread)  # the row under way is checked first; a Ctrl-C ends the wait
