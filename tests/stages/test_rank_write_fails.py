"""A full disk while one rank writes a file of its own (its profiler trace, the damaged-sample list) stops every
rank with that rank's one line and status 1, as a checkpoint's full disk does; no rank goes on into the next
collective. Before: the trace's failure raised on its rank alone, and the other rank waited in the next step's
gradient all-reduce until the failed rank's exit broke the connection (gloo: a "connection closed" error instead
of the line; NCCL: the collective timeout). Two gloo processes (tests/stages/rank_write_fails.py), one launch
per case."""

from __future__ import annotations

import pytest

from damage import flip_bit, sample_byte
from train_store import key_of, make_train_store, mixed_specs
from two_ranks import launch_two


@pytest.mark.parametrize("case, what", [("trace", "trace-rank1.json"), ("damaged", "damaged_samples.jsonl")])
def test_a_full_disk_on_one_ranks_own_file_stops_every_rank(tiny_edit_model, tmp_path, case, what) -> None:
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    if case == "damaged":
        flip_bit(*sample_byte(store, "vae", key_of(3), "target"), 6)
    outs = launch_two("rank_write_fails.py", case, str(store), tiny_edit_model, str(tmp_path / "run"), timeout=300)
    (rc0, out0, err0), (rc1, out1, err1) = outs
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 1, (rc0, rc1, err0[-2000:], err1[-2000:])
    last0, last1 = err0.strip().splitlines()[-1], err1.strip().splitlines()[-1]
    assert last0 == last1, (last0, last1)
    assert last0.startswith("error: ") and "disk full" in last0 and what in last0, last0
    assert not (tmp_path / "run" / "lora").exists()
