"""What resize-bucket holds for its quarantine rows until the commit: before, a Python dict per rejected sample
(`DictRows` below, the former `Intake.rejects` list); now text columns in Arrow buffers (stages/resize/reject_rows.py).

1. rows: --rows rows as `Intake.reject` makes them for a bad batch (`unreadable-image`, key and pictures known, a
   ~60-char path, the decoder's ~120-char detail), held the old and the new way: Python memory traced
   (tracemalloc) plus Arrow's pool, per row, and the commit's append of them into a fresh store (seconds, peak).
2. stage: a folder source of --samples samples whose targets are not images (the tests' hostile files: an error
   page saved as .png), one resize-bucket run each way in this process: traced + Arrow memory when the commit
   starts, and the quarantine.parquet rows checked equal (but `time`).

    PYTHONPATH=. python bench/resize_reject_memory.py                    # ~50 s: --rows 100000 --samples 10000
    PYTHONPATH=. python bench/resize_reject_memory.py --rows 1000000 --samples 0

2-core machine shared with 5 other jobs, one run (24 s CPU, ~2 min wall under that load), default sizes:
  rows 100000 (this part rerun alone, --samples 0, with the column-by-column merge of bench/quarantine_merge.py):
               old  held 68.2 MiB (715 B a row), commit 1.31 s, RSS peak +117.4 MiB over its start
               new  held  7.2 MiB ( 75 B a row), commit 0.28 s, RSS peak  +59.4 MiB over its start
    (1M bad samples: ~700 MB held for the whole run before, ~72 MB now; the commit's peak: the file's bytes and
    the merge of the rows into it, store/quarantine.py `merged_rows`, ~130 B a new row: bench/quarantine_merge.py)
  stage 10000 bad samples: old  rows 8.3 MiB; traced + arrow at the commit +11.3 MiB over the run's start
                           new  rows 1.9 MiB (2 chunks, 1808 rows still dicts);                +9.3 MiB
    (in a run the rows' key and source texts are shared with `Intake.first_source`, which keeps them anyway)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pyarrow as pa


class DictRows(list):
    """The former rows: a list of the row dicts, changed in place, taken back by a filter of the list."""

    def add(self, row: dict[str, Any]) -> int:
        self.append(row)
        return len(self) - 1

    def set_detail(self, n: int, detail: str) -> None:
        self[n]["detail"] = detail

    def drop(self, n: int) -> None:  # the former settle: one filter (no bench source takes a row back)
        raise NotImplementedError

    def first(self) -> dict[str, Any]:
        return self[0]

    def table(self) -> pa.Table:
        """The text columns the former commit's `add_rows` built from the dicts (`time` its own)."""
        from store.quarantine import BASE_COLUMNS, text_column

        cols = dict.fromkeys(c for c in BASE_COLUMNS if c != "time")
        for r in self:
            cols.update(dict.fromkeys(r))
        return pa.table({c: text_column([r.get(c) for r in self]) for c in cols})


def held() -> int:
    """Python memory traced plus Arrow's pool, in bytes."""
    gc.collect()
    return tracemalloc.get_traced_memory()[0] + pa.total_allocated_bytes()


def footprint(rows: Any) -> int:
    """The bytes the rows themselves take: each dict and its texts (some shared with the run's other records),
    and for `RejectRows` its compressed chunks."""
    dicts = rows if isinstance(rows, DictRows) else rows._recent
    size = sum(sys.getsizeof(r) + sum(sys.getsizeof(v) for v in r.values()) for r in dicts)
    return size + (0 if isinstance(rows, DictRows) else sum(c.size for c in rows._chunks))


def rss(field: str = "VmRSS") -> int:
    """This process's resident memory (`VmHWM`: its peak since `reset_peak_rss`), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)


def fill(intake: Any, rows: int) -> None:
    from schemas.errors import Rejected
    from stages.resize.sources import SourceSample

    for i in range(rows):
        path = f"/data/edits/batch_{i // 10000:04d}/target/pair_{i:07d}.png"
        rec = SourceSample(name=f"pair_{i:07d}", source=path, files=[path], target=b"x")
        key = hashlib.sha256(str(i).encode()).hexdigest()[:32]
        intake.reject(rec, Rejected("unreadable-image", f"target ({path}): not a readable image (formats accepted: "
                                    "PNG, JPEG, WEBP, TIFF, BMP, GIF)", key=key))


def rows_part(rows: int) -> None:
    from stages.resize.intake import Intake
    from stages.resize.summary import ResizeSummary
    from store import Store

    out = {}
    for way in ("old", "new"):
        intake = Intake(ResizeSummary(version=1))
        if way == "old":
            intake.rejects = DictRows()
        before = held()
        fill(intake, rows)
        kept = held() - before
        with tempfile.TemporaryDirectory() as d:
            st = Store(Path(d) / "s")
            base = rss()
            reset_peak_rss()
            start = time.perf_counter()
            st.add_quarantine(intake.rejects) if way == "old" else st.add_quarantine_table(intake.rejects.table())
            seconds = time.perf_counter() - start
            peak = rss("VmHWM") - base
            out[way] = st.quarantine().drop(["time"])
        print(f"rows {rows}: {way}  held {kept / 2**20:7.1f} MiB ({kept / rows:4.0f} B a row); commit {seconds:5.2f} s,"
              f" RSS peak {peak / 2**20:+7.1f} MiB over its start")
        del intake
    assert out["old"].equals(out["new"]), "old and new append different rows"


def make_bad_source(root: Path, n: int) -> None:
    (root / "target").mkdir(parents=True)
    for i in range(n):
        (root / "target" / f"pair_{i:07d}.png").write_bytes(b"<html>404 Not Found</html> %d" % i)
        (root / "target" / f"pair_{i:07d}.txt").write_text(f"make edit number {i}")


def stage_part(samples: int, work: Path) -> None:
    from pipeline.config import load_config
    from stages.resize import stage
    from stages.resize.intake import Intake
    from store import Store

    src = work / "src"
    os.environ.setdefault("XDG_CACHE_HOME", str(work / "cache"))  # the file-hash cache: not the user's
    make_bad_source(work / "warm", 10)
    make_bad_source(src, samples)
    cfg = load_config(None, {"resize.workers": 0})
    real_commit, out = stage.commit_version, {}
    with contextlib.suppress(Exception):  # every import made before either way is measured
        stage.run(cfg, work / "warm", work / "warm_store")
    for way in ("old", "new"):
        at_commit: list[int] = []

        def measured(st, writer, source, intake):
            at_commit.extend([held() - at_start, rss(), footprint(intake.rejects)])
            reset_peak_rss()
            try:
                return real_commit(st, writer, source, intake)
            finally:  # nothing usable: the commit refuses it after appending the quarantine
                at_commit.append(rss("VmHWM"))  # [3]

        def intake_of(summary, way=way):
            intake = Intake(summary)
            if way == "old":
                intake.rejects = DictRows()
            return intake

        stage.commit_version, stage.Intake = measured, intake_of
        start, at_start = time.perf_counter(), held()
        try:
            stage.run(cfg, src, work / way)
        except Exception as e:  # noqa: BLE001 - "no usable sample": the rows are appended first
            assert "no usable sample" in str(e), e
        finally:
            stage.commit_version, stage.Intake = real_commit, Intake
        out[way] = Store(work / way).quarantine().drop(["time"])
        print(f"stage {samples} bad samples: {way}  rows {at_commit[2] / 2**20:5.1f} MiB; traced + arrow at the commit "
              f"{at_commit[0] / 2**20:+5.1f} MiB over the run's start, the commit's RSS peak "
              f"{(at_commit[3] - at_commit[1]) / 2**20:+5.1f} MiB over its start; run {time.perf_counter() - start:4.1f} s")
    assert out["old"].num_rows == samples and out["old"].equals(out["new"]), "old and new quarantine differ"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    a = ap.parse_args()
    tracemalloc.start()
    if a.rows:
        rows_part(a.rows)
    if a.samples:
        work = Path(a.dir or tempfile.mkdtemp(prefix="resize_reject_memory_"))
        try:
            stage_part(a.samples, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
