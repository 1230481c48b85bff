"""A non-finite loss on one rank of two: every rank stops (or skips the step) with the same line, naming the
sample that caused it (stages/train/guard.py `nonfinite_message`, over every rank's per-sample losses). Before,
each rank named its own samples: the rank without the bad one blamed "a non-finite gradient from the step's
samples" and listed its own (innocent) keys, and with two different lines the one shown depended on which rank
published first; with skip_step every rank printed its own version."""

from __future__ import annotations

from train_store import key_of, make_train_store, mixed_specs
from two_ranks import launch_two, results


def test_a_nonfinite_sample_on_one_rank_is_named_alike_on_every_rank(tiny_edit_model, tmp_path) -> None:
    store = tmp_path / "store"
    # 2 samples, batch 1 on 2 ranks: one global step per epoch; the bad sample is on exactly one rank each step
    make_train_store(store, tiny_edit_model, mixed_specs(2), poison={1: float("inf")})
    bad, good = key_of(1), key_of(0)
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_nonfinite.py", str(store), tiny_edit_model,
                                                      str(tmp_path / "out"))
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-3000:], err1[-3000:])
    r0, r1 = results(out0), results(out1)
    assert r0["stop"] == r1["stop"], (r0["stop"], r1["stop"])  # the same line on both ranks
    assert f"optimizer step 1: non-finite loss of samples {bad};" in r0["stop"], r0["stop"]
    assert good not in r0["stop"].split(";")[0], r0["stop"]
    assert r0["skipped"] == r1["skipped"] == "[1, 2]", (r0, r1)
    skipped = [line for line in (out0 + out1).splitlines() if line.startswith("skipped ")]
    # printed once per step (by the main process), naming the bad sample only
    assert skipped == [f"skipped optimizer step 1: non-finite loss of samples {bad}",
                       f"skipped optimizer step 2: non-finite loss of samples {bad}"], skipped
