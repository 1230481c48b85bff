"""What the old-revision-vs-this-checkout bench scripts share: the old code unpacked beside the repository, and
runs interleaved old/new so that a machine's load drifting during the bench hits both sides alike.

A module for bench/cold_start.py, exit_time.py and meta_memory.py (the old revision), and quarantine_columns.py,
resize_counts.py and reuse_rows.py (the old way kept beside the new in a child script); run alone it only unpacks a
revision:

    python bench/old_vs_new.py REV INTO
"""

from __future__ import annotations

import argparse
import os
import statistics
import json
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

REPO = Path(__file__).resolve().parents[1]


def old_tree(rev: str, into: Path) -> Path:
    """The code of commit `rev`, extracted with `git archive` into `into`/old (nothing in the repository changes)."""
    out = into / "old"
    out.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def bench_args(doc: str, repeat: int, work_holds: str) -> argparse.Namespace:
    """The command line of a bench: the old revision, how many interleaved runs, a fixture folder to keep."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", help="git revision to compare with (e.g. main, HEAD~3)")
    ap.add_argument("--repeat", type=int, default=repeat)
    ap.add_argument("--work", type=Path, help=f"fixture folder (kept; reused when it holds {work_holds})")
    return ap.parse_args()


@contextmanager
def bench_folders(args: argparse.Namespace, prefix: str) -> Iterator[tuple[Path, Path]]:
    """(a temp folder for the old tree, removed after; the fixture folder: --work, else one inside the temp one)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = args.work or Path(tmp) / "work"
        work.mkdir(parents=True, exist_ok=True)
        yield Path(tmp), work


def env_for(tree: Path) -> dict[str, str]:
    """A command's environment: the code of `tree`, offline, one torch thread (as the tests run it)."""
    return {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def interleaved_medians(repeat: int, old: Callable[[], Sequence[float]],
                        new: Callable[[], Sequence[float]]) -> tuple[list[float], list[float]]:
    """Run `old` then `new` `repeat` times; the median of each figure they return, old's and new's."""
    runs: dict[str, list[Sequence[float]]] = {"old": [], "new": []}
    for _ in range(repeat):
        runs["old"].append(old())
        runs["new"].append(new())
    return tuple([statistics.median(r[i] for r in runs[k]) for i in range(len(runs[k][0]))]  # type: ignore[return-value]
                 for k in ("old", "new"))


# a child script's peak RSS: VmHWM (ru_maxrss would count the parent's, kept across exec); prepended to CHILD texts
HWM = r"""
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
"""


def child_json(code: str, *argv: str) -> dict:
    """Run `code` (a bench's child script) in a fresh interpreter over this checkout; its last stdout line, JSON."""
    out = subprocess.run([sys.executable, "-c", HWM + code, *argv], cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def best_interleaved(repeat: int, measure: Callable[[str], dict],
                     least: Sequence[str] = ("peak_mb", "seconds")) -> tuple[dict, dict]:
    """`measure("old")` then `measure("new")`, `repeat` times; per side its first run's figures with the least of
    each of `least` over its runs (the run least disturbed by the machine's other jobs)."""
    best: dict[str, dict] = {}
    for _ in range(repeat):
        for way in ("old", "new"):
            r = measure(way)
            b = best.setdefault(way, r)
            for k in least:
                b[k] = min(b[k], r[k])
    return best["old"], best["new"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="git revision to unpack")
    ap.add_argument("into", type=Path, help="an existing folder; the code goes to INTO/old")
    args = ap.parse_args()
    print(old_tree(args.rev, args.into))
