"""An encode run whose model refuses some samples for their control count (an Edit model over a dataset where some
pairs have 0 or 2 controls): before its first batch each rank asks the rule of its keys' `num_controls`, at the
writer's open (`output._model_takes`: refused keys are never carried) and again in `read_inputs` (refused keys are
quarantined unread), whose check-ahead looked the same keys up a third time; the table's distinct counts were taken
by the plan's check, then at each of the two asks. Now the keys are looked up once (at the writer's open, their rows
handed to `read_inputs` with the keys, `intake.Todo`) and the distinct counts taken once (`intake.control_census`).

Synthetic: a KeyIndex of --samples sorted 64-hex-digit keys (content hashes, as the `images` table's), 1% of them
with 2 controls, the rest 1; one rank's keys asked in a shuffled order. Measures, best of --repeat, after checking
both give the same refusals, counts and check-ahead rows:
  old   the three lookups and three distinct counts (intake.py / output.py at f82bb71f, verbatim below)
  new   the calls the stages make now
2-core machine shared with other jobs (load 4-6), best of 3: 1M samples old 11.72 s, new 4.72 s (2.5x); 100k
samples 0.84 s, 0.24 s.

    PYTHONPATH=. python bench/encode_refused_controls.py --samples 1000000
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's stages/, not an installed one

from _common import samples_and_repeat, synthetic_keys  # noqa: E402
from stages.encode import intake  # noqa: E402
from stages.encode.intake import control_count_rejection  # noqa: E402
from stages.encode.output import _model_takes  # noqa: E402
from store.key_index import KeyIndex  # noqa: E402


class Images:
    """The part of a TableReader the control-count checks use."""

    def __init__(self, keys: list[str], counts: np.ndarray):
        self.index = KeyIndex(pa.array(keys, pa.string()), "table 'images' v1")
        self.counts = pa.chunked_array([pa.array(counts, pa.int64())])

    def rows_of_keys(self, keys):
        return self.index.rows_of_keys(keys)

    def column(self, name):
        return self.counts

    def has_column(self, name):
        return name == "num_controls"

    def __len__(self):
        return len(self.counts)


def rule(n: int, key: str):
    return control_count_rejection("edit", n, key)


# ------------------------------------------------------------------ before (f82bb71f), verbatim but for names

def old_refused_by_controls(job, keys, rule):
    if rule is None or not keys or not job.images.has_column("num_controls") or not old_refuses_any(job, rule):
        return [0] * len(keys), [False] * len(keys)
    at = job.images.rows_of_keys(pa.array(keys, pa.string()))
    counts = old_control_counts(job.images.column("num_controls").take(pa.array(np.maximum(at, 0))))
    distinct = np.unique(counts)
    no = np.array([rule(int(n), "") is not None for n in distinct], bool)
    refused = no[np.searchsorted(distinct, counts)] & (at >= 0)
    return counts.tolist(), refused.tolist()


def old_refuses_any(job, rule):
    return any(rule(int(n), "") is not None for n in np.unique(old_control_counts(job.images.column("num_controls"))))


def old_control_counts(column):
    return pc.fill_null(column, 0).to_numpy(zero_copy_only=False).astype(np.int64)


def old_path(job, todo):
    np.unique(old_control_counts(job.images.column("num_controls")), return_counts=True)  # check_any_allowed
    _, refused = old_refused_by_controls(job, todo, job.by_controls)  # _model_takes
    carriable = [k for k, no in zip(todo, refused) if not no]
    counts, refused = old_refused_by_controls(job, todo, job.by_controls)  # read_inputs
    at = job.images.rows_of_keys(pa.array(todo, pa.string()))  # _rows_to_read
    ahead = at[(at >= 0) & ~np.asarray(refused, bool)].tolist()
    return carriable, counts, refused, ahead


# ------------------------------------------------------------------ now

def new_path(job, todo):
    intake.control_census(job)  # check_any_allowed
    at = intake.key_rows(job, todo) if intake.refuses_any(job, job.by_controls) else None  # open_writer
    carriable = _model_takes(job, todo, at)
    todo = intake.Todo(tuple(todo), at)  # open_writer's return
    at = intake.rows_of(job, todo)  # read_inputs
    counts, refused = intake.refused_by_controls(job, todo, job.by_controls, at)
    ahead = at[(at >= 0) & ~np.asarray(refused, bool)].tolist()
    return carriable, counts, refused, ahead


def main() -> None:
    args = samples_and_repeat()
    keys, todo = synthetic_keys(args.samples)
    counts = np.where(np.random.default_rng(0).random(args.samples) < 0.01, 2, 1)
    images = Images(keys, counts)
    best = {"old": float("inf"), "new": float("inf")}
    for _ in range(args.repeat):
        job = SimpleNamespace(images=images, by_controls=rule, control_census=None)
        t0 = time.perf_counter()
        old = old_path(job, todo)
        best["old"] = min(best["old"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        new = new_path(job, todo)
        best["new"] = min(best["new"], time.perf_counter() - t0)
        assert old == new and sum(new[2]) == int((counts == 2).sum())
    print(f"samples={args.samples}  old {best['old']:.2f} s  new {best['new']:.2f} s  "
          f"old / new {best['old'] / best['new']:.1f}x")


if __name__ == "__main__":
    main()
