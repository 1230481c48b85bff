"""Join tables by sample key (the trainer reads `text` + `vae` as one sample)."""

from __future__ import annotations

import logging
from typing import Any

from schemas.errors import UserError
from store.partition import epoch_order
from store.reader import TableReader

log = logging.getLogger("store")


class JoinedReader:
    """Inner join on key. Keys missing from some table are counted in `unmatched` and logged, not silently lost."""

    def __init__(self, readers: dict[str, TableReader]) -> None:
        if len(readers) < 2:
            raise UserError("a join needs at least two tables")
        self.readers = readers
        key_sets = {t: set(r.keys()) for t, r in readers.items()}
        common = set.intersection(*key_sets.values())
        self.unmatched = {t: len(ks - common) for t, ks in key_sets.items()}
        if any(self.unmatched.values()):
            log.warning("join of %s: keys only in one side dropped: %s", list(readers), self.unmatched)
        first = next(iter(readers.values()))
        self._keys = [k for k in first.keys() if k in common]  # first table's (sorted) key order

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[str]:
        return list(self._keys)

    def get(self, key: str) -> dict[str, dict[str, Any]]:
        return {t: r.get(key) for t, r in self.readers.items()}

    def meta(self, key: str) -> dict[str, dict[str, Any]]:
        return {t: r.meta(key) for t, r in self.readers.items()}

    def iter_keys(
        self, split: str | None = None, rank: int = 0, world_size: int = 1,
        seed: int | None = None, epoch: int = 0, buffer_size: int = 1024,
    ) -> list[str]:
        """Same ordering rules as one table, grouped by the first table's shards."""
        keep = set(self._keys)
        groups = [[k for k in g if k in keep] for g in next(iter(self.readers.values())).shard_groups(split)]
        return epoch_order([g for g in groups if g], rank, world_size, seed, epoch, buffer_size)
