"""The `images` rows an encoder's check-ahead walks (stages/encode/intake.py `read_inputs`), for a rank's keys:
before, `row_of` per key (a binary search from Python, a `str.encode` and a numpy scalar each); now one
`rows_of_keys` over the whole list (stages/encode/intake.py `key_rows`). Synthetic: a KeyIndex of --samples
sorted 64-hex-digit keys (content hashes, as the `images` table's), the keys asked in a shuffled order; both
checked to give the same rows.

    PYTHONPATH=. python bench/encode_input_rows.py --samples 1000000

2-core machine shared with other jobs (load 8-9), best of 3, 1M samples:
  row_of per key 10.9 s (7.6 s in a second run); rows_of_keys 5.4 s as it was (numpy's searchsorted of the keys
  in their shuffled order: a cache miss per step); 1.9 s with the keys searched in sorted order (store/key_index.py)
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from _common import samples_and_repeat, synthetic_keys
from store.key_index import KeyIndex


def main() -> None:
    args = samples_and_repeat()
    keys, asked = synthetic_keys(args.samples)
    index = KeyIndex(pa.array(keys, pa.string()), "table 'images' v1")
    best = {"old": float("inf"), "new": float("inf")}
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        old = [index.row_of(k) for k in asked]
        best["old"] = min(best["old"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        at = index.rows_of_keys(pa.array(asked, pa.string()))
        new = at[at >= 0].tolist()
        best["new"] = min(best["new"], time.perf_counter() - t0)
        assert old == new and np.all(at >= 0)
    print(f"samples={args.samples}  row_of per key {best['old']:.2f} s   rows_of_keys {best['new']:.2f} s")


if __name__ == "__main__":
    main()
