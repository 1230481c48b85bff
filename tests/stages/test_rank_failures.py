"""One rank fails where only it works; every rank stops together, within the test's timeout, non-zero, with
the same one line and no traceback (models/collective/). Two gloo processes on the CPU (started directly with
the launcher's environment, so each one's output is its own), running every case in turn
(tests/stages/rank_failures.py): rank 0 out of disk space in a train checkpoint, in the final LoRA, in the run
folder's train_config.yaml and attention.json, and in an encode commit; then rank 1 meets a damaged `images` sample (encode-vae through the CLI). Before: rank 0
printed its line, rank 1 died with a gloo "connection closed" traceback (NCCL: waited for the timeout)."""

from __future__ import annotations

import shutil
from pathlib import Path

from damage import flip_bit, sample_byte
from store import Store
from train_store import make_train_store, mixed_specs
from two_ranks import launch_two, results

def test_a_failure_on_one_rank_stops_every_rank_with_its_line(tiny_edit_model, edit_store, tmp_path) -> None:
    train_store = tmp_path / "train-store"
    make_train_store(train_store, tiny_edit_model, mixed_specs(8))
    damaged = Path(shutil.copytree(edit_store, tmp_path / "damaged-store"))
    with Store(damaged).reader("images") as images:
        theirs = images.iter_keys(rank=1, world_size=2)
    assert theirs
    flip_bit(*sample_byte(damaged, "images", theirs[0]), 2)

    outs = launch_two("rank_failures.py", str(train_store), tiny_edit_model, str(tmp_path / "out"),
                      str(edit_store), str(damaged))
    (rc0, out0, err0), (rc1, out1, err1) = outs
    assert "Traceback" not in err0 + out0 and "Traceback" not in err1 + out1, (err0[-3000:], err1[-3000:])
    r0, r1 = results(out0), results(out1)
    assert r0 == r1 and set(r0) == {"checkpoint", "final", "run folder", "attention record", "commit"}, (r0, r1)
    assert "checkpoint step-1" in r0["checkpoint"] and "the final LoRA" in r0["final"], r0
    assert "manifest" in r0["commit"], r0
    assert "the run folder" in r0["run folder"], r0  # before: rank 1 waited at the barrier, rank 0 a traceback
    assert "attention.json" in r0["attention record"], r0  # before: rank 1 waited in DDP's first broadcast
    for line in r0.values():
        assert "disk full" in line or "No space left" in line, line
    # the damaged sample of rank 1: both ranks exit 1 with rank 1's one line
    assert rc0 == rc1 == 1, (rc0, rc1, err0[-2000:], err1[-2000:])
    last0, last1 = err0.strip().splitlines()[-1], err1.strip().splitlines()[-1]
    assert last0 == last1 and last0.startswith("error: ") and theirs[0] in last0, (last0, last1)
