"""Validation's main-process work (the sample grid, the losses.zarr append) failing on rank 0 stops every rank
with the same one line and no traceback. Before: rank 0 ended in a traceback (out of memory generating the
samples) while rank 1 waited in the next step's gradient all-reduce until the watch thread stopped it with
rank 0's bare exception text (NCCL: the same, had rank 0 not published it: the collective timeout)."""

from __future__ import annotations

import pytest

from train_store import make_train_store, mixed_specs
from two_ranks import launch_two


@pytest.fixture(scope="module")
def store(tiny_edit_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("valfail") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(8, 2))
    return root


@pytest.mark.parametrize("case,expected", [
    ("samples-oom", ["rank 0 ran out of memory in the validation of step 2", "Tried to allocate", "train.sample_count"]),
    ("record-disk-full", ["disk full while writing the validation losses", "losses.zarr"]),
])
def test_rank_0_failing_in_validation_stops_every_rank_with_one_line(case, expected, store, tiny_edit_model, tmp_path):
    outs = launch_two("rank_validation_fails.py", case, str(store), tiny_edit_model, str(tmp_path / "run"),
                      timeout=300)
    (rc0, out0, err0), (rc1, out1, err1) = outs
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 1, (rc0, rc1, err0[-2000:], err1[-2000:])
    last0, last1 = err0.strip().splitlines()[-1], err1.strip().splitlines()[-1]
    assert last0 == last1 and last0.startswith("error: "), (last0, last1)
    assert all(e in last0 for e in expected), last0
    assert (tmp_path / "run" / "checkpoints" / "step-1").is_dir()  # what was committed stays


def test_the_other_ranks_wait_for_the_sample_grid_outside_any_collective(store, tiny_edit_model, tmp_path):
    """Rank 0 alone generates the sample grid. Before, the other ranks went on into the next step and waited for
    it in the gradient all-reduce: minutes of generation (a 20B model, many steps, true CFG) passed NCCL's
    10-minute collective timeout and killed the run. Now they wait through the launcher's store
    (`models.collective.main_alone`), with no timeout, and the run completes."""
    from two_ranks import results

    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_validation_fails.py", "samples-wait", str(store),
                                                      tiny_edit_model, str(tmp_path / "run"), timeout=300)
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-2000:], err1[-2000:])
    assert results(out0)["went_on"] == "False", out0
    assert (tmp_path / "run" / "samples" / "step-000002.png").is_file()
