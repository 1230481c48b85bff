"""The one wording of counts shown to users."""

from __future__ import annotations

from schemas.units import count_text


def test_count_text_puts_the_noun_in_its_number():
    assert [count_text(n, "shard") for n in (0, 1, 2)] == ["0 shards", "1 shard", "2 shards"]
    assert count_text(1, "entry", "entries") == "1 entry" and count_text(3, "entry", "entries") == "3 entries"
