"""The bookkeeping of resize-bucket's revivals (stages/resize/render_loop.py `_revive`): each first copy the rendering
rejected (a bad mask) has its next copy taken back from the quarantine (`take_back`) and, once kept, its later
copies named as that copy's duplicates (`kept_instead`). Before, each revived copy searched the quarantine rows for
its own (`next(i for ... if r is row)`) and `summary.duplicates.remove`d its pair: both lists grow with the
source, so a source with many rejected first copies (a mask folder of the wrong aspect: every sample) was
quadratic. Now the rows and pairs let go are marked (row numbers, stages/resize/reject_rows.py; a Counter of
pairs) and dropped once (the rows when read at the commit, the pairs at `settle_revivals`).
Synthetic: --keys keys, each a first copy rejected then 2 held duplicates (the first revived, the second its
duplicate), after --others other quarantine rows; old and new checked to leave the same rows and pairs.

    PYTHONPATH=. python bench/revival_bookkeeping.py --keys 5000 20000 50000

2-core machine shared with other jobs, one run each (--others 10000):
  keys=2000    old  1.12 s   new 0.016 s
  keys=5000    old  4.32 s   new 0.058 s
  keys=20000   old 66.3 s    new 0.375 s
  50k (quadratic from 5k-20k): old ~7 min, new ~1 s; 1M revived copies: old days, new ~20 s
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from schemas.errors import Rejected
from stages.resize.sources import SourceSample
from stages.resize.intake import Intake
from stages.resize.summary import ResizeSummary


class OldRows(list):
    """The former `Intake.rejects`: a list of row dicts, each row its own handle (`add` gives it back)."""

    def add(self, row: dict) -> dict:
        self.append(row)
        return row


def intake_with_held(keys: int, others: int, old: bool = False) -> tuple[Intake, list[tuple[str, list]]]:
    intake = Intake(ResizeSummary(version=1))
    if old:
        intake.rejects = OldRows()
    for i in range(others):
        intake.reject(SourceSample(name=f"o{i}", source=f"other/{i}"), Rejected("bad-caption", "x", key=None))
    held = []
    for k in range(keys):
        key = f"k{k:08d}"
        intake.first_source[key] = f"src/{k}/0"
        copies = []
        for c in (1, 2):
            rec = SourceSample(name=key, source=f"src/{k}/{c}")
            copies.append((rec, intake.reject(rec, Rejected("duplicate", "same content", key=key))))
        held.append((key, copies))
    return intake, held


def old_take_back(intake: Intake, key: str, rec: SourceSample, row: dict) -> None:
    # the former `Intake.take_back`, verbatim
    del intake.rejects[next(i for i, r in enumerate(intake.rejects) if r is row)]
    intake.summary.quarantined["duplicate"] -= 1
    if not intake.summary.quarantined["duplicate"]:
        del intake.summary.quarantined["duplicate"]
    intake.summary.duplicates.remove((intake.first_source[key], rec.source))


def old_kept_instead(intake: Intake, key: str, kept: SourceSample, later: list) -> None:
    # the former `Intake.kept_instead`, verbatim
    for rec, row in later:
        row["detail"] = f"same content (target, controls, caption) as {kept.source}"
        intake.summary.duplicates.remove((intake.first_source[key], rec.source))
        intake.summary.duplicates.append((kept.source, rec.source))


def revive(intake: Intake, held: list, old: bool) -> float:
    start = time.perf_counter()
    for key, copies in held:
        (rec, row), later = copies[0], copies[1:]
        (old_take_back if old else Intake.take_back)(intake, key, rec, row)
        (old_kept_instead if old else Intake.kept_instead)(intake, key, rec, later)
    if not old:
        intake.settle_revivals()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, nargs="+", default=[5000, 20000, 50000])
    ap.add_argument("--others", type=int, default=10000)
    args = ap.parse_args()
    for n in args.keys:
        results = {}
        for old in (True, False):
            intake, held = intake_with_held(n, args.others, old)
            seconds = revive(intake, held, old)
            rows = intake.rejects if old else intake.rejects.table().to_pylist()
            results[old] = (seconds, [{k: v for k, v in r.items() if v is not None} for r in rows],
                            list(intake.summary.duplicates),
                            Counter(intake.summary.quarantined))
        assert results[True][1:] == results[False][1:], "old and new leave different rows"
        print(f"keys={n:>7}  old {results[True][0]:8.2f} s   new {results[False][0]:6.3f} s")


if __name__ == "__main__":
    main()
