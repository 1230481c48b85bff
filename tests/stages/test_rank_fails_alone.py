"""A rank that fails where the others do not wait for it in an agreement still stops every rank: both exit 1
within the test's timeout with the same one line and no traceback (models/collective/alone.py `fails_alone`, the
watch thread, `open_job`'s agreement). Two gloo processes on the CPU started with the launcher's environment
(tests/stages/rank_fails_alone.py). Before: in train, rank 1's out-of-memory traceback while rank 0 waited in
DDP's all-reduce until rank 1's exit broke the connection (NCCL: until the collective timeout); in encode, rank
0 loaded the model and encoded its share before it failed at the commit."""

from __future__ import annotations

import pytest

from train_store import make_train_store, mixed_specs
from two_ranks import launch_two


def _launch(*args: str) -> list[tuple[int, str, str]]:
    return launch_two("rank_fails_alone.py", *args, timeout=300)


def _same_line_everywhere(outs: list[tuple[int, str, str]]) -> str:
    (rc0, out0, err0), (rc1, out1, err1) = outs
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 1, (rc0, rc1, err0[-2000:], err1[-2000:])
    last0, last1 = err0.strip().splitlines()[-1], err1.strip().splitlines()[-1]
    assert last0 == last1 and last0.startswith("error: "), (last0, last1)
    return last0


@pytest.mark.parametrize("failing", [1, 0])  # rank 0 also serves the launch's store (it waits for the others)
def test_out_of_memory_in_one_ranks_backward_stops_every_rank(tiny_edit_model, tmp_path, failing) -> None:
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    line = _same_line_everywhere(_launch("train-oom", str(store), tiny_edit_model, str(tmp_path / "run"), str(failing)))
    assert f"rank {failing} ran out of memory in optimizer step 1" in line and "Tried to allocate" in line, line
    assert "train.batch_size" in line, line  # what to change
    assert not (tmp_path / "run" / "lora").exists()


@pytest.mark.parametrize("interrupted", [1, 0])
def test_a_ctrl_c_on_one_rank_mid_step_stops_every_rank_at_once(tiny_edit_model, tmp_path, interrupted) -> None:
    """A Ctrl-C that reached one rank alone (its own terminal) in its forward: the other, inside DDP's all-reduce,
    ends with one line naming the stop and how to go on, and the interrupted rank stops as a Ctrl-C stops it (130,
    its own line, nothing committed past the last checkpoint).
    Before: the KeyboardInterrupt was not published; the other rank waited in the collective (NCCL without
    torchrun: 10 minutes) and, under gloo, ended on a lost peer named as killed."""
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    outs = _launch("train-interrupt", str(store), tiny_edit_model, str(tmp_path / "run"), str(interrupted))
    (rc_i, out_i, err_i), (rc_o, out_o, err_o) = outs[interrupted], outs[1 - interrupted]
    assert "Traceback" not in err_o + out_o + err_i + out_i, (err_o[-3000:], err_i[-3000:])
    assert rc_i == 130 and rc_o == 1, (rc_i, rc_o, err_i[-2000:], err_o[-2000:])
    errors = [line for line in err_o.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: rank {interrupted} was stopped by SIGINT (Ctrl-C) in optimizer step 1: what the ranks "
                      "committed is kept (a run's checkpoints); rerun the same command to continue (`run train`: "
                      "with --resume)"], err_o[-2000:]
    # a plain env:// launch: no torchrun agent says the stop for it (before: a silent exit 130)
    assert err_i.strip().splitlines()[-1] == ("stopped by SIGINT (Ctrl-C): the run's checkpoints are kept; rerun with "
                                             "--resume to continue from the last one"), err_i[-2000:]
    assert not (tmp_path / "run" / "lora").exists()


def test_out_of_memory_in_one_ranks_optimizer_step_stops_every_rank_with_advice(tiny_edit_model, tmp_path) -> None:
    """Adam allocates its state in the first `optimizer.step()`, after the backward: out of memory there on rank 1
    stops both ranks with the same line naming it and what to change, as in the forward and backward. Before:
    rank 1's traceback and a generic "rank 1 failed: OutOfMemoryError" line, no advice."""
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    line = _same_line_everywhere(_launch("train-optimizer-oom", str(store), tiny_edit_model, str(tmp_path / "run"), "1"))
    assert "rank 1 ran out of memory in optimizer step 1" in line and "Tried to allocate" in line, line
    assert "train.optimizer" in line, line  # what to change: a smaller optimizer state
    assert not (tmp_path / "run" / "lora").exists()


def test_one_rank_failing_to_open_encode_inputs_stops_every_rank(tiny_edit_model, edit_store) -> None:
    line = _same_line_everywhere(_launch("encode-open", str(edit_store), tiny_edit_model))
    assert "rank 1 cannot hold a read lease" in line, line


def test_a_run_folder_another_train_is_writing_stops_every_rank(tiny_edit_model, tmp_path) -> None:
    """Only rank 0 takes the run folder's lock: refused there, it must not leave rank 1 waiting for it at the
    opening of the store (before: rank 1 died of gloo's "connection closed", or waited for NCCL's timeout)."""
    from stages.train.guard import RunDirLock

    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    held = RunDirLock(tmp_path / "run")  # another `train` into the same --out
    try:
        line = _same_line_everywhere(_launch("train-locked", str(store), tiny_edit_model, str(tmp_path / "run")))
    finally:
        held.release()
    assert "is being written by" in line and str(tmp_path / "run") in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_device_list_shorter_than_the_processes_stops_every_rank(tiny_edit_model, edit_store) -> None:
    """`encode_vae.device=[cpu]` for two processes: local rank 1 has no device. Every rank of the node knows the
    list is short (LOCAL_WORLD_SIZE), so all stop with the same line; before, only rank 1 was refused and rank 0
    waited for it at the opening of the inputs (gloo: "connection closed"; NCCL: until the timeout)."""
    line = _same_line_everywhere(_launch("encode-devices", str(edit_store), tiny_edit_model))
    assert "encode_vae.device: 1 device(s) listed" in line and "2 processes" in line, line


def test_the_damaged_input_limit_of_an_encode_is_judged_over_every_rank(tiny_edit_model, edit_store) -> None:
    """encode on_damaged=skip with one damaged sample, in rank 1's share. Over the limit for the table: both
    ranks stop with the same line. Then `max_damaged_fraction` between 1 / samples and 1 / (rank 1's share):
    within the limit for the table (as one process finds), over it for rank 1's share alone. Before: rank 1
    judged alone against its share and stopped both ranks (damage sits in shards and a rank's share is whole
    shards: with more ranks, an encode that one process finishes failed)."""
    from damage import flip_bit, sample_byte
    from store import Store

    with Store(edit_store).reader("images") as images:
        keys, theirs = images.keys(), images.iter_keys(rank=1, world_size=2)
    assert 1 < len(theirs) < len(keys)
    flip_bit(*sample_byte(edit_store, "images", theirs[0]), 2)
    line = _same_line_everywhere(_launch("encode-skip", str(edit_store), tiny_edit_model, str(0.5 / len(keys))))
    assert "max_damaged_fraction" in line, line

    fraction = 1 / (len(keys) - 0.5)  # 1 > fraction x share, 1 <= fraction x samples
    (rc0, out0, err0), (rc1, out1, err1) = _launch("encode-skip", str(edit_store), tiny_edit_model, str(fraction))
    assert rc0 == rc1 == 0, (err0[-2000:], err1[-2000:])
    st = Store(edit_store)
    with st.reader("vae") as vae:
        assert sorted(vae.keys()) == sorted(k for k in keys if k != theirs[0])
    assert theirs[0] in st.quarantine().column("key").to_pylist()


def test_damaged_inputs_of_several_ranks_add_up_to_the_encode_limit(tiny_edit_model, edit_store) -> None:
    """One damaged sample in each rank's share, `max_damaged_fraction` between 1 / samples and 2 / samples:
    each rank alone is within the table's limit, the two together are over it (as one process finds): every
    rank stops with the same line, nothing is committed."""
    from damage import flip_bit, sample_byte
    from store import Store

    with Store(edit_store).reader("images") as images:
        keys = images.keys()
        shares = [images.iter_keys(rank=r, world_size=2) for r in (0, 1)]
    for share in shares:
        flip_bit(*sample_byte(edit_store, "images", share[0]), 2)
    line = _same_line_everywhere(_launch("encode-skip", str(edit_store), tiny_edit_model, str(1.5 / len(keys))))
    assert f"2 of {len(keys)} samples" in line and "max_damaged_fraction" in line, line
    assert "vae" not in Store(edit_store).tables()
