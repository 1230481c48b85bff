"""`KeyIndex.rows_of_keys` / `TableReader.rows_of_keys`: a whole column of keys to row numbers at once (-1 where the
table lacks a key), equal to `row_of` key by key on every kind of key column: sorted content hashes (binary search
on the fixed-width view), keys of mixed lengths or unsorted (Arrow's hash lookup), probes of another width, chunked
probes, nothing to look up."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from store.key_index import KeyIndex


def _expected(index: KeyIndex, probe: list[str]) -> list[int]:
    return [-1 if (i := index.row_of(k)) is None else i for k in probe]


def test_rows_of_keys_equals_row_of_key_by_key():
    hashes = sorted(f"{i * 7919:032x}" for i in range(50))
    columns = {
        "sorted hashes": hashes,
        "unsorted": hashes[::-1],
        "mixed lengths": sorted(["a", "bb", "ccc", *hashes[:5]]),
    }
    for name, keys in columns.items():
        index = KeyIndex(pa.array(keys, pa.string()), f"table {name}")
        probes = [keys[3], "missing", keys[0], keys[-1], f"{1:032x}", keys[3], "z" * 32, keys[0][:-1]]
        for probe in (probes, [k for k in probes if len(k) == 32], [keys[-1]], []):
            got = index.rows_of_keys(pa.array(probe, pa.string()))
            assert got.dtype == np.int64 and got.tolist() == _expected(index, probe), (name, probe)
        chunked = pa.chunked_array([pa.array(probes[:3], pa.string()), pa.array(probes[3:], pa.string())])
        assert index.rows_of_keys(chunked).tolist() == _expected(index, probes), name
        assert index.rows_of_keys(pa.array(probes, pa.large_string())).tolist() == _expected(index, probes), name
