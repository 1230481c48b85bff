"""Counts as every summary, progress line and error shows them: `count_text` gives "1 shard" / "2 shards".
Here because models/, store/, stages/ and pipeline/ all may import schemas/."""

from __future__ import annotations


def count_text(n: int, noun: str, nouns: str | None = None) -> str:
    """`n` and the noun in its number: "1 shard", "0 shards", "3 shards"; `nouns` where the plural is not noun + s
    ("1 entry", "2 entries")."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"


def size_text(nbytes: int | float) -> str:
    """KiB below 0.1 MiB (a manifest's 30 KiB is no "0.0 MiB"), MiB below 10000 MiB, GiB below 10000 GiB, then
    TiB: one decimal, at most four digits before it (a 1.2 TiB store is "1228.8 GiB", not "1258291.2 MiB"); under
    1 KiB, bytes."""
    if nbytes < 1024:
        return f"{int(nbytes)} B"
    if nbytes < 0.1 * 2**20:
        return f"{nbytes / 2**10:.0f} KiB"
    for unit, scale in (("MiB", 2**20), ("GiB", 2**30)):
        if round(nbytes / scale, 1) < 10_000:  # by the shown figure: 9999.96 MiB is "9.8 GiB", not "10000.0 MiB"
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes / 2**40:.1f} TiB"
