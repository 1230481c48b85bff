"""The table versions a launch's ranks read, checked to be one and the same on every rank.

Each rank opens the store itself and takes a read lease on the current versions. A commit between two ranks'
opens, a shared folder whose view of store.json lags on one node, or a store path that names a separate copy on
each node would give ranks different features: samples of two versions mixed into one run or loss grid, or
ranks with different sample lists (and so different step counts) waiting in different collectives. A version
number alone cannot tell two copies apart (a table deleted and rebuilt restarts at v1), so the ranks compare the
versions' identities (`Store.version_id`: number and manifest hash), in one all-reduce.
"""

from __future__ import annotations

from pathlib import Path

from schemas.errors import UserError


def check_same_versions(world: int, ids: dict[str, str], store_root: str | Path, stage: str) -> None:
    """`ids`: table -> this rank's version id (`Store.version_id`), the same tables in the same order on every
    rank. Returns when every rank reads the same versions; otherwise every rank raises the same line."""
    if world <= 1:
        return
    from models.collective import spread

    numbers = [n for vid in ids.values() for n in _as_numbers(vid)]
    spreads = spread(world, numbers)
    for i, table in enumerate(ids):
        (high, low), *digest = spreads[3 * i : 3 * i + 3]
        if high != low:
            raise UserError(f"{stage}: the ranks do not read the same table '{table}' of {store_root} (v{high} on "
                            f"some, v{low} on others: it was rebuilt during this launch, or the store is a shared "
                            "folder some nodes see late); rerun once `pipeline store inspect` shows it alike from "
                            "every node")
        if any(a != b for a, b in digest):
            raise UserError(f"{stage}: the ranks read different contents as table '{table}' v{high} of {store_root} "
                            "(each node holds its own copy of the store at that path, and the copies differ, or "
                            "the table was deleted and rebuilt during this launch); --store must be one store every "
                            "node sees alike: a shared folder, or a store URL")


def _as_numbers(version_id: str) -> tuple[int, int, int]:
    """`v<N>-<16 hex digits>` as (N, high 32 bits, low 32 bits) of the hash: integers an all-reduce carries."""
    number, digest = version_id[1:].split("-", 1)
    return int(number), int(digest[:8], 16), int(digest[8:16], 16)
