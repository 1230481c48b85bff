"""`models.ordered_map`: results in input order, lazily consumed input bounded by `ahead`, inline without an
executor (the one prefetch mechanism of resize and encode)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from models.ordered_map import ordered_map


def test_results_in_input_order_whatever_finishes_first():
    gates = [threading.Event() for _ in range(6)]

    def work(i: int) -> int:
        if i < 5:
            gates[i + 1].wait(10)  # item i finishes only after item i + 1 has started: reverse completion
        gates[i].set()
        return i * i

    with ThreadPoolExecutor(6) as pool:
        out = list(ordered_map(work, range(6), pool, ahead=5))
    assert out == [(i, i * i) for i in range(6)]


def test_input_is_read_at_most_ahead_items_beyond_the_one_yielded():
    pulled: list[int] = []

    def items():
        for i in range(20):
            pulled.append(i)
            yield i

    with ThreadPoolExecutor(2) as pool:
        for i, r in ordered_map(lambda x: -x, items(), pool, ahead=3):
            assert r == -i
            assert len(pulled) <= i + 1 + 3  # bounded memory: never the whole input


def test_inline_without_executor():
    assert list(ordered_map(str, [1, 2], None, ahead=0)) == [(1, "1"), (2, "2")]
