"""One append to STORE/quarantine.parquet at scale (`store/quarantine.py`): each encode rank appends its rejects at
its commit, one rank after another under the store lock, and the file holds every encode version's rejects.

Builds `--existing` rows (rejects of `--versions` encode versions: 32-hex keys, table_version in each row) and
`--new` incoming rows (half repeat rows already there: a resumed run's retries), then measures, in the same run:
  old      the former `merged_rows` (every existing row as a Python tuple in a set), kept below as the baseline
  new      `quarantine.merged_rows` (the vectorised rule)
  append   `quarantine.merge_into` end to end with each rule: read the file, merge, write it back
Prints each time (best of --repeat) and old / new, checking both give the same table.

    python bench/quarantine_append.py --existing 1000000 --new 1000
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import timeit
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's store/, not an installed one

from store import format as fmt  # noqa: E402
from store import quarantine  # noqa: E402


def old_merged_rows(old: pa.Table | None, rows: pa.Table) -> tuple[pa.Table, int]:
    """The rule before the vectorised one (store/quarantine.py at 307a050), verbatim."""
    if old is None or not old.num_rows:
        old = None
    identity = [c for c in rows.column_names if c != "time"]

    def idents(t: pa.Table) -> list[tuple[str | None, ...]]:
        have = {c: t.column(c).to_pylist() if c in t.column_names else [None] * t.num_rows for c in identity}
        return list(zip(*(have[c] for c in identity))) if identity else [()] * t.num_rows

    seen = set(idents(old)) if old is not None else set()
    keep = []
    for i, ident in enumerate(idents(rows)):
        if ident not in seen:
            seen.add(ident)
            keep.append(i)
    if not keep:
        return (old if old is not None else rows.slice(0, 0)), 0
    fresh = rows.take(pa.array(keep, pa.int64()))
    return (fresh if old is None else pa.concat_tables([old, fresh], promote_options="permissive")), len(keep)


def rows(n: int, versions: int, first_version: int, rng: np.random.Generator) -> pa.Table:
    """n encode rejects spread over `versions` versions of vae / text (one key rejected once per version)."""
    keys = [f"{k:032x}" for k in rng.integers(0, 2**63, max(n // versions, 1)).tolist()]
    key = np.array(keys)[np.arange(n) % len(keys)]
    version = first_version + np.arange(n) // len(keys)
    stage = np.where(version % 2 == 0, "encode-vae", "encode-text")
    reason = np.array(["damaged-input", "control-count", "prompt-too-long"])[rng.integers(0, 3, n)]
    cols = {
        "key": key, "source": np.char.add(np.char.add("shards/part-0007.tar:", key), ".jpg"), "stage": stage,
        "reason": reason, "detail": np.char.add("read failed at byte ", rng.integers(0, 10**6, n).astype(str)),
        "time": np.full(n, "2025-01-01T00:00:00+00:00"),
        "table_version": np.char.add(np.where(stage == "encode-vae", "vae/v", "text/v"), version.astype(str)),
    }
    return pa.table({c: pa.array(v.tolist(), pa.string()) for c, v in cols.items()})


def best(fn, repeat: int) -> float:
    """The fastest of `repeat` calls (the least disturbed by the shared machine's other load)."""
    return min(timeit.repeat(fn, number=1, repeat=repeat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--existing", type=int, default=1_000_000)
    ap.add_argument("--new", type=int, default=1000)
    ap.add_argument("--versions", type=int, default=25)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    old = rows(a.existing, a.versions, 1, rng)
    again = old.take(pa.array(rng.choice(old.num_rows, a.new // 2, replace=False)))  # retried: not repeated
    incoming = pa.concat_tables([again, rows(a.new - a.new // 2, 1, a.versions + 1, rng)])
    (want, n_old), (got, n_new) = old_merged_rows(old, incoming), quarantine.merged_rows(old, incoming)
    assert n_old == n_new == a.new - a.new // 2 and got.equals(want), "the two rules disagree"
    t_old = best(lambda: old_merged_rows(old, incoming), a.repeat)
    t_new = best(lambda: quarantine.merged_rows(old, incoming), a.repeat)
    t_append = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        fmt.atomic_write_bytes(root / "existing.parquet", quarantine.to_bytes(old))  # sealed, as the product writes
        for name, rule in (("old", old_merged_rows), ("new", quarantine.merged_rows)):
            times = []
            for _ in range(a.repeat):
                shutil.copyfile(root / "existing.parquet", root / fmt.QUARANTINE)  # the file before the append
                with mock.patch.object(quarantine, "merged_rows", rule):
                    t0 = time.perf_counter()
                    quarantine.merge_into(root, incoming)
                    times.append(time.perf_counter() - t0)
            t_append[name] = min(times)
    print(json.dumps({"existing": a.existing, "new": a.new, "added": n_new, "old_s": round(t_old, 3),
                      "new_s": round(t_new, 4), "old_over_new": round(t_old / t_new, 1),
                      "append_old_s": round(t_append["old"], 3), "append_new_s": round(t_append["new"], 3),
                      "append_old_over_new": round(t_append["old"] / t_append["new"], 1)}))


if __name__ == "__main__":
    main()
