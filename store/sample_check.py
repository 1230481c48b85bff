"""Is a sample's stored bytes what was written? The shard-level problems found on open, the per-sample checksum
check, which rows passed (once per reader: versions are immutable), and the error a damaged sample raises.
Part of the reader (store/reader.py); the check-ahead thread (store/check_ahead.py) uses the same `problem`.
"""

from __future__ import annotations

from typing import Any

from store import integrity
from store.integrity import DamagedData
from store.manifest_view import ManifestView
from store.shard_io import ShardFiles


class SampleCheck:
    def __init__(self, view: ManifestView, bad_shards: dict[str, str], records_damage: bool = True) -> None:
        self.view, self.bad_shards = view, bad_shards
        self.records_damage = records_damage  # damage found is recorded in the store (integrity.record_damage)
        # One byte per row, 1 once its bytes matched: a reader lives for a whole training, whose ranks read more of
        # the table every epoch. A set of the rows held ~60 B a row read (its table and an int each: ~60 MB per table
        # and rank at 1M rows by epoch 16 on 8 ranks, bench/checked_rows.py); this ~1 MB whatever is read.
        self._checked = bytearray(len(view))

    def is_checked(self, i: int) -> bool:
        try:  # one item read is atomic under the GIL: the check-ahead thread asks it too
            return i >= 0 and self._checked[i] == 1
        except IndexError:  # no row of this table (as a set answered): whoever reads it finds out
            return False

    def mark_checked(self, i: int) -> None:
        self._checked[i] = 1

    def mark_all_checked(self) -> None:
        """Trust every row (bench/store_read.py measures reads without checks this way)."""
        self._checked = bytearray(b"\x01") * len(self.view)

    @property
    def checked_count(self) -> int:
        return self._checked.count(1)

    def shard_problem(self, shard: str, start: int, n: int) -> str | None:
        """What the open-time check found wrong with a shard, if it makes this sample unreadable."""
        if shard not in self.bad_shards:
            return None
        try:
            size = (self.view.dir / shard).stat().st_size
        except FileNotFoundError:
            return self.bad_shards[shard]
        if size < start + n:
            return f"{self.bad_shards[shard]}; the sample lies beyond its end"
        if size == 0:
            return self.bad_shards[shard]
        return None

    def shard_damage(self) -> dict[str, str]:
        """key -> problem of every sample the open-time check makes unreadable (`shard_problem`, the text `refuse`
        records for it): recorded on open with the shards in one write, so meeting these samples later adds
        nothing to the marker; one by one, a lost shard of thousands of samples cost one locked, fsync'd rewrite
        of the whole marker per sample."""
        if not self.bad_shards:
            return {}
        out: dict[str, str] = {}
        for i in self.view.samples.rows_in(self.bad_shards).tolist():
            problem = self.shard_problem(*self.view.samples.locate(i))
            if problem is not None:
                out[self.view.keys.array[i].as_py()] = problem
        return out

    def bytes_problem(self, i: int, buf: Any, at: int, n: int) -> str | None:
        """What is wrong with sample i's n bytes at `at` in `buf` (None: they match their checksum)."""
        with memoryview(buf) as mv:
            part = mv[at : at + n]
            try:
                return integrity.sample_problem(part, self.view.samples.checksum_row(i))
            finally:
                part.release()

    def problem(self, i: int, files: ShardFiles) -> str | None:
        """Sample i checked from scratch, its bytes read by pread through `files` (never a map: a shard cut short
        under the reader is then a problem string, not SIGBUS)."""
        shard, start, n = self.view.samples.locate(i)
        problem = self.shard_problem(shard, start, n)
        if problem is not None:
            return problem
        got = files.pread(shard, start, n)
        return got if isinstance(got, str) else self.bytes_problem(i, got, 0, n)

    def refuse(self, i: int, shard: str, problem: str) -> DamagedData:
        """The error for damaged sample i (recorded in the store, so the stage that wrote the version does not
        call it up to date)."""
        key = self.view.keys.array[i].as_py()
        if self.records_damage:
            integrity.record_damage(self.view.dir, {key: problem})
        return DamagedData(integrity.damaged_sample_message(self.view.dir, shard, key, problem))

    def refuse_shard(self, shard: str) -> DamagedData:
        vdir = self.view.dir
        return DamagedData(f"{integrity.where(vdir)}: {self.bad_shards[shard]}; {integrity.repair_hint(vdir)}")
