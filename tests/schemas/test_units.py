"""The one wording of counts and byte sizes shown to users."""

from __future__ import annotations

import pytest

from schemas.units import count_text, size_text


def test_count_text_puts_the_noun_in_its_number():
    assert [count_text(n, "shard") for n in (0, 1, 2)] == ["0 shards", "1 shard", "2 shards"]
    assert count_text(1, "entry", "entries") == "1 entry" and count_text(3, "entry", "entries") == "3 entries"


@pytest.mark.parametrize(("nbytes", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (30_000, "29 KiB"), (104_857, "102 KiB"), (104_858, "0.1 MiB"),
    (812_400_000, "774.8 MiB"), (9_999.9 * 2**20, "9999.9 MiB"), (9_999.96 * 2**20, "9.8 GiB"),
    (1_234.6 * 2**30, "1234.6 GiB"), (9_999.9 * 2**30, "9999.9 GiB"), (10_000 * 2**30, "9.8 TiB"),
    (123.5 * 2**40, "123.5 TiB"),
])
def test_size_text_is_binary_and_keeps_four_digits_before_the_point(nbytes, text):
    """gc, encode summaries, inspect, push / pull, the store cache's limits and disk-free lines: one rule, binary
    units (they said kB / MB / GB of 10^3 beside tqdm's bars in powers of 1024 and MiB elsewhere); a 1.2 TiB store
    is "1228.8 GiB", not "1258291.2 MiB"."""
    assert size_text(nbytes) == text
