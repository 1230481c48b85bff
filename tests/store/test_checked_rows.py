"""Which rows a reader has checked (store/sample_check.py): each sample's bytes CRC-checked once per reader, the
record small whatever a training reads. Train's readers live for the whole run and each epoch adds another share
of the table: as a set of row numbers the record grew ~60 bytes a row read (~60 MB per table and rank at 1M rows,
bench/checked_rows.py); a byte per row now."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from damage import flip_bit, key_at, sample_byte
from store import Store
from store.integrity import DamagedData
from store.sample_check import SampleCheck
from store_samples import fill


class _View:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_the_checked_rows_cost_about_a_byte_a_row_whatever_is_read() -> None:
    n = 100_000
    np.random.default_rng(0).permutation(2)  # numpy.random's lazy imports, not the record, before the count
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        check = SampleCheck(_View(n), {})
        for epoch in range(4):  # a rank's shares of 4 epochs: new int objects each, as `int(rows[i])` makes them
            for i in np.random.default_rng(epoch).permutation(n)[: n // 2].tolist():
                if not check.is_checked(i):
                    check.mark_checked(i)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    read = set()
    for epoch in range(4):
        read.update(np.random.default_rng(epoch).permutation(n)[: n // 2].tolist())
    assert check.checked_count == len(read)
    assert [check.is_checked(i) for i in range(n)] == [i in read for i in range(n)]
    assert held < 2 * n, f"{held / n:.1f} bytes per row"  # a set of the rows: ~60 bytes a row read


def test_rows_out_of_the_table_are_not_checked() -> None:
    check = SampleCheck(_View(3), {})
    check.mark_checked(2)
    assert check.is_checked(2) and not check.is_checked(0)
    assert not check.is_checked(3) and not check.is_checked(-1)  # not the last row's answer
    check.mark_all_checked()
    assert check.checked_count == 3 and not check.is_checked(3)


def test_a_read_row_is_checked_once_and_a_damaged_one_never_marked(store: Store, monkeypatch) -> None:
    fill(store, 8)
    key = key_at(store.root, "vae", 5)
    flip_bit(*sample_byte(store.root, "vae", key, offset=3), 4)
    r = store.reader("vae")
    crcs: list[int] = []
    real = r.checks.bytes_problem
    monkeypatch.setattr(r.checks, "bytes_problem", lambda i, *a, **k: crcs.append(i) or real(i, *a, **k))
    for i in (0, 2, 0, 7, 2):
        r.tensors_at(i)
    assert crcs == [0, 2, 7]  # each row's bytes checked on its first read only
    assert [r.checks.is_checked(i) for i in range(len(r))] == [i in (0, 2, 7) for i in range(len(r))]
    for _ in range(2):
        with pytest.raises(DamagedData):
            r.tensors_at(5)
    assert crcs == [0, 2, 7, 5, 5] and not r.checks.is_checked(5)  # refused each time, never trusted
    assert r.checks.checked_count == 3
    r.close()
