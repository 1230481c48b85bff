"""A manifest's key column and the lookups by key: row numbers by binary search on a zero-copy fixed-width view of
sorted keys (content hashes: the usual case), a key -> row dict built only for other keys, the keys as a Python
list built only for whole-table walks. Part of the manifest view (store/manifest_view.py), which parses the column.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.errors import UserError
from store.arrow_columns import fixed_width_view, strictly_increasing


class KeyIndex:
    """The parsed key column (`array`: the only one the view holds) and what lookups built over it, each on first
    use."""

    def __init__(self, array: pa.StringArray, where: str) -> None:
        self.array = array
        self.sorted = strictly_increasing(array)
        self.where = where  # "table 't' vN", for the error of a missing key
        self._list: list[str] | None = None
        self._row_of: dict[str, int] | None = None
        self._sorted_fixed: np.ndarray | None | bool = False  # False: not looked at yet

    def adopt(self, other: "KeyIndex") -> None:
        """Use another version's parsed key column, equal to this one's (the caller compared them): a joined
        `text` and `vae` hold the same keys, ~36 MB at 1M samples kept once instead of twice per rank."""
        self.array = other.array
        self._sorted_fixed, self._list, self._row_of = False, None, None

    def __len__(self) -> int:
        return len(self.array)

    def as_list(self) -> list[str]:
        """The keys as Python strings (kept): for whole-table walks only."""
        if self._list is None:
            self._list = self.array.to_pylist()
        return self._list

    @property
    def listed(self) -> bool:
        """Whether the keys are kept as a Python list (`as_list`)."""
        return self._list is not None

    def row_of(self, key: str) -> int | None:
        """The key's row number, or None. Sorted fixed-width keys (content hashes: the usual case) are found by
        binary search on a zero-copy view of the key column; a million-entry key -> row dict (~1 s, ~170 MB at
        1M samples) is built only for other keys."""
        if self._sorted_fixed is False:
            self._sorted_fixed = fixed_width_view(self.array) if self.sorted else None
        keys = self._sorted_fixed
        if keys is None:
            if self._row_of is None:
                self._row_of = {k: i for i, k in enumerate(self.as_list())}
            return self._row_of.get(key)
        b = key.encode()
        if len(b) != keys.dtype.itemsize or b"\0" in b:  # numpy `S` values drop trailing NULs
            return None
        i = int(np.searchsorted(keys, b))
        return i if i < len(keys) and keys[i] == b else None

    def rows_of_keys(self, keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """Each key's row number (-1: not in the table), for a whole column of keys at once: one binary search over
        the sorted fixed-width keys (the usual case), else Arrow's hash lookup; no Python str per key."""
        if isinstance(keys, pa.ChunkedArray):
            keys = keys.combine_chunks()
        if not pa.types.is_string(keys.type):
            keys = keys.cast(pa.string())
        if self._sorted_fixed is False:
            self._sorted_fixed = fixed_width_view(self.array) if self.sorted else None
        table, probe = self._sorted_fixed, fixed_width_view(keys)
        if table is not None and probe is not None and probe.dtype == table.dtype:
            # equal widths, keys without NUL bytes (KEY_RE): numpy's `S` comparison is the bytewise one here.
            # Searched in sorted order: keys in another order (a shuffled share) each searched the whole table from
            # its middle, a cache miss per step (1M: 5.3 s; sorted first 1.5 s, bench/encode_input_rows.py)
            order = np.argsort(probe)
            at = np.empty(len(probe), np.int64)
            at[order] = np.searchsorted(table, probe[order])
            at = np.minimum(at, len(table) - 1)
            return np.where(table[at] == probe, at, -1).astype(np.int64)
        found = pc.index_in(keys, value_set=self.array).fill_null(-1)
        return found.to_numpy(zero_copy_only=False).astype(np.int64)

    @property
    def dict_built(self) -> bool:
        """Whether lookups by key needed the key -> row dict (tests: the usual keys never do)."""
        return self._row_of is not None

    def index(self, key: str) -> int:
        """The key's row number; a UserError when the table lacks it."""
        i = self.row_of(key)
        if i is None:
            raise UserError(f"key {key} not in {self.where}")
        return i
