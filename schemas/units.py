"""Counts as every summary, progress line and error shows them: `count_text` gives "1 shard" / "2 shards".
Here because models/, store/, stages/ and pipeline/ all may import schemas/."""

from __future__ import annotations


def count_text(n: int, noun: str, nouns: str | None = None) -> str:
    """`n` and the noun in its number: "1 shard", "0 shards", "3 shards"; `nouns` where the plural is not noun + s
    ("1 entry", "2 entries")."""
    return f"{n} {noun if n == 1 else (nouns or noun + 's')}"
