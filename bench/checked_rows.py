"""What a reader keeps of the rows it has checked (store/sample_check.py `SampleCheck`), over a training's epochs.

Every reader remembers which rows' bytes matched their checksum, so each sample is CRC-checked once per reader;
train's readers (`text` and `vae`, one each per rank) live for the whole run, and each epoch hands a rank another
random share of the table, so the rows it has checked grow epoch by epoch towards the whole table
(1 - (1 - 1/W)^E of it after E epochs on W ranks). Measured in the same run, per --samples table size:
  old   the former record, a Python set of row numbers (kept below verbatim as the baseline): its hash table and
        an int object per row (the row numbers come from numpy, `int(rows[i])`: a new int each)
  new   `SampleCheck`: a byte per row
one rank of --world-size reading its share of each of --epochs epochs (a fresh random permutation per epoch, the
consumer's `is_checked` / `mark_checked` per row as the reader calls them). Prints after selected epochs the rows
checked, the bytes each record holds (tracemalloc, the row lists of the epochs freed), old / new, and the time of
the epoch loop. Checks both answer `is_checked` alike for every row at the end.

    python bench/checked_rows.py --samples 100000 1000000 --world-size 8 --epochs 16

2-core shared dev machine (load ~2), one rank of 8, 16 epochs (88% of the table read by the end), per table:
  1M rows    after epoch 1 (12%): old 7.8 MB, new 0.95 MB (8x); epoch 4 (41%): 28.6 / 0.95 MB (30x);
             epoch 16 (88%): 58.9 / 0.95 MB (62x); the 16 epochs' calls: old 2.37 s, new 0.92 s (2.6x)
  100k rows  epoch 16: old 7.3 MB, new 0.10 MB (75x); 0.06 / 0.03 s
A training rank holds two such readers (text, vae): at 1M samples on 8 ranks, ~120 MB a rank (~1 GB a node) by
epoch 16 before, ~2 MB now. Evaluate's and the encoders' readers kept theirs the same way.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one

from store.sample_check import SampleCheck  # noqa: E402


class OldChecked:
    """The former record (store/sample_check.py before a byte per row), verbatim."""

    def __init__(self, n: int) -> None:
        self._checked: set[int] = set()  # rows whose bytes matched (a set: ~60 MB at 1M only if all are read)

    def is_checked(self, i: int) -> bool:
        return i in self._checked  # a set lookup is atomic under the GIL: the check-ahead thread asks it too

    def mark_checked(self, i: int) -> None:
        self._checked.add(i)

    @property
    def checked_count(self) -> int:
        return len(self._checked)


class _View:
    """What `SampleCheck` reads of its manifest view for these calls: the number of rows."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def run(kind: str, n: int, world: int, epochs: int, report: set[int]) -> tuple[list[tuple[int, int, int]], float, bytes]:
    """[(epoch, rows checked, bytes held)], the loop's seconds, and every row's `is_checked` as bytes."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    check = OldChecked(n) if kind == "old" else SampleCheck(_View(n), {})
    out, seconds = [], 0.0
    share = n // world
    for e in range(1, epochs + 1):
        rows = np.random.default_rng(e).permutation(n)[:share].tolist()  # this rank's share, new ints
        t0 = time.perf_counter()
        for i in rows:  # the reader's calls for a row read (`_checked_bytes`): ask, check, mark
            if not check.is_checked(i):
                check.mark_checked(i)
        seconds += time.perf_counter() - t0
        del rows
        if e in report:
            out.append((e, check.checked_count, tracemalloc.get_traced_memory()[0] - base))
    tracemalloc.stop()
    answers = bytes(check.is_checked(i) for i in range(n))
    return out, seconds, answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=16)
    args = ap.parse_args()
    report = {1, 2, 4, 8, 16, 32, 64, args.epochs}
    for n in args.samples:
        old, t_old, a_old = run("old", n, args.world_size, args.epochs, report)
        new, t_new, a_new = run("new", n, args.world_size, args.epochs, report)
        assert a_old == a_new, "the two records answer is_checked differently"
        print(f"{n} rows, one rank of {args.world_size}: epoch loop old {t_old:.2f} s, new {t_new:.2f} s "
              f"({t_old / t_new:.2f}x)")
        for (e, rows, b_old), (_, rows_new, b_new) in zip(old, new):
            assert rows == rows_new
            print(f"  after epoch {e:3d}: {rows:8d} rows checked ({rows / n:4.0%})   old {b_old / 2**20:7.1f} MB   "
                  f"new {b_new / 2**20:6.2f} MB   old / new {b_old / b_new:6.1f}x")


if __name__ == "__main__":
    main()
