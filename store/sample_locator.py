"""Where each sample of a manifest lies and what it is checked against: its shard (the dictionary-encoded column's
indices, numpy), offset and size, and its checksum (`sample_crc32c` kept as uint32 numbers where it can be). Part
of the manifest view (store/manifest_view.py), whose parsed columns it reads; the check itself:
store/sample_check.py.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import pyarrow as pa

from store.arrow_columns import fixed_width_view, release_memory

if TYPE_CHECKING:
    from store.manifest_view import ManifestView


def crc_numbers(column: pa.Array) -> np.ndarray | None:
    """A `sample_crc32c` column as uint32 numbers when every value is 8 lowercase hex digits, as the writer writes
    them; else None."""
    raw = fixed_width_view(column)
    if raw is None or raw.dtype.itemsize != 8:
        return None
    digits = raw.view(np.uint8)
    if not np.all(((digits >= 48) & (digits <= 57)) | ((digits >= 97) & (digits <= 102))):  # 0-9 a-f
        return None
    return np.frombuffer(bytes.fromhex(digits.tobytes().decode()), dtype=">u4").astype(np.uint32)


class SampleLocator:
    """Sample locations and checksums over a view's columns; the shard numbers and the crc numbers are built on
    first use."""

    def __init__(self, view: "ManifestView") -> None:
        # a proxy, not a reference: view -> locator -> view would be a cycle, and the view's parsed columns
        # (hundreds of MB at 1M samples) would then wait for the cyclic collector instead of going with the view
        self._view = weakref.proxy(view)
        self._shard_idx: np.ndarray | None = None  # row -> shard number (dictionary index), numpy
        self._shard_names: list[str] = []
        self._crc_u32: np.ndarray | None | bool = False  # sample_crc32c as numbers (False: not looked at yet)
        self._all_hex: bool | None = None  # `crcs_at`: is every sample_crc32c 8 hex digits (None: not looked at)

    def shard_numbers(self) -> tuple[np.ndarray, list[str]]:
        """(each row's shard number, the shard names by number): the dictionary-encoded column's indices (numpy,
        no per-row str). A name may have more than one number (dictionaries of several row groups)."""
        if self._shard_idx is None:
            col = self._view.column("shard")
            if not pa.types.is_dictionary(col.type):
                col = col.dictionary_encode()
            self._shard_idx = col.indices.to_numpy(zero_copy_only=False)
            self._shard_names = col.dictionary.to_pylist()
        return self._shard_idx, self._shard_names

    def shard_of(self, i: int) -> str:
        """Sample i's shard file name."""
        idx, names = self.shard_numbers()
        return names[idx[i]]

    def rows_in(self, shards: Iterable[str]) -> np.ndarray:
        """The rows whose samples lie in these shards, in row order."""
        if not len(self._view):
            return np.zeros(0, np.int64)
        idx, names = self.shard_numbers()
        wanted = set(shards)
        numbers = [j for j, name in enumerate(names) if name in wanted]
        return np.flatnonzero(np.isin(idx, numbers))

    def locate(self, i: int) -> tuple[str, int, int]:
        """(shard, offset, nbytes) of sample i's bytes; the numeric columns are read as numpy views of Arrow."""
        offs = self._view.column("sample_offset").to_numpy()
        sizes = self._view.column("sample_nbytes").to_numpy()
        return self.shard_of(i), int(offs[i]), int(sizes[i])

    def crcs(self) -> np.ndarray | None:
        """The `sample_crc32c` column as uint32 numbers (4 bytes a row, not a 12-byte string: ~8 MB less at 1M
        samples) when every value is 8 lowercase hex digits, as the writer writes them; else None (the strings
        are read as they are)."""
        if self._crc_u32 is False:
            self._crc_u32 = crc_numbers(self._view.column("sample_crc32c"))
            if self._crc_u32 is not None:
                self._view.drop_replaced("sample_crc32c")  # the strings go: the numbers say the same
                release_memory()
        return self._crc_u32

    def crcs_at(self, rows: np.ndarray) -> np.ndarray | None:
        """`crcs()[rows]` without parsing or keeping the whole column where `crcs` has not run: whether every value
        is 8 hex digits (what makes them numbers) is told a row group at a time, the rows' values read from their
        groups alone (`ManifestView.column_at`). None where `crcs()` is None."""
        if self._crc_u32 is not False or "sample_crc32c" in self._view.parsed:
            crcs = self.crcs()
            return None if crcs is None else crcs[rows]
        if self._all_hex is None:
            return self._first_crcs_at(np.asarray(rows, np.int64))
        if not self._all_hex:
            return None
        if len(rows) == 0:
            return np.zeros(0, np.uint32)
        return crc_numbers(self._view.column_at("sample_crc32c", rows))

    def _first_crcs_at(self, rows: np.ndarray) -> np.ndarray | None:
        """`crcs_at`'s first call: the rows' numbers taken from the row groups that tell whether every value is 8
        hex digits, so each group is decoded once (`column_at` after that pass decoded the groups holding the rows
        again, on the one call a join's content id makes)."""
        picked, start = np.zeros(len(rows), np.uint32), 0
        all_hex = len(self._view) > 0
        for group in self._view.column_groups("sample_crc32c") if all_hex else ():
            numbers = crc_numbers(group) if len(group) else np.zeros(0, np.uint32)
            if numbers is None:
                all_hex = False
                break
            inside = (rows >= start) & (rows < start + len(group))
            picked[inside] = numbers[rows[inside] - start]
            start += len(group)
        if all_hex and len(rows) and (rows.min() < 0 or rows.max() >= start):  # as column_at would: never a 0
            raise IndexError(f"rows {rows.min()}..{rows.max()} asked of a manifest of {start} rows")
        self._all_hex = all_hex  # told only once every group was read (a damaged one raises: asked again)
        release_memory()
        return picked if all_hex else None

    def checksum_row(self, i: int) -> dict[str, Any]:
        """What sample i's bytes are checked against (store/integrity.py `sample_problem`)."""
        view = self._view
        if "sample_crc32c" in view.names:  # format 2: the sha256 column (64 MB at 1M samples) is never parsed
            crcs = self.crcs()
            crc = f"{int(crcs[i]):08x}" if crcs is not None else view.cell("sample_crc32c", i)
            if crc:
                return {"sample_crc32c": crc}
        return {"sample_sha256": view.cell("sample_sha256", i), "sample_crc32c": None}

    def prepare_checks(self) -> None:
        """Parse the columns a sample check reads (before another thread checks: it then only reads them)."""
        view = self._view
        names = ["shard", "sample_offset", "sample_nbytes"]
        if "sample_crc32c" not in view.names:
            names.append("sample_sha256")
        for name in names:
            if name in view.names:
                view.column(name)
        if "sample_crc32c" in view.names and self.crcs() is None:
            view.column("sample_crc32c")
        if len(view):
            self.shard_numbers()
