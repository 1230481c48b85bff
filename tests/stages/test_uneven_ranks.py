"""Ranks that come to an agreement far apart (tests/stages/rank_uneven.py, two gloo processes): those that come
first wait for the others through the launcher's store (`collective.arrive_together`), not inside the agreement's
collective, whose timeout ended them. NCCL's is 10 minutes, and ranks come further apart than that: the end of a
multi-hour encode's shares (one holding the samples new since the last encode, a slower node), a node loading the
model from a slower disk; the encode then died after all its work, the training before its first step. Here rank
0's process group times out after 5 s and rank 1 comes 12 s after it. A rank killed meanwhile still stops the rank
waiting for it, with one line, instead of a wait for ever."""

from __future__ import annotations

from store import Store
from train_store import make_train_store, mixed_specs
from two_ranks import launch_two


def test_a_rank_that_ends_its_encode_share_long_after_the_others_is_waited_for(tiny_edit_model, edit_store,
                                                                                tmp_path) -> None:
    (rc0, out0, err0), (rc1, out1, err1) = launch_two(
        "rank_uneven.py", "encode-late", str(edit_store), tiny_edit_model, str(tmp_path / "marker"), "5", "12",
        timeout=400)
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-3000:], err1[-3000:])  # before: rank 0 "Timed out waiting 5000ms"
    with Store(edit_store).reader("vae") as vae, Store(edit_store).reader("images") as images:
        assert sorted(vae.keys()) == sorted(images.keys())  # every rank's share committed, nothing lost


def test_a_rank_killed_before_the_end_of_its_encode_share_stops_the_rank_waiting_for_it(tiny_edit_model, edit_store,
                                                                                         tmp_path) -> None:
    (rc0, out0, err0), (rc1, _, _) = launch_two(
        "rank_uneven.py", "encode-killed", str(edit_store), tiny_edit_model, str(tmp_path / "marker"), "5",
        timeout=400)
    assert rc1 != 0 and rc0 == 1, (rc0, rc1, err0[-3000:])
    last = err0.strip().splitlines()[-1]
    assert last.startswith("error: ") and "rank(s) 1 of 2 gave no sign of life" in last, last
    assert "rerun the same command" in last, last
    assert "vae" not in Store(edit_store).tables()  # nothing committed; a rerun resumes the shards written


def test_a_rank_that_loads_the_model_long_after_the_others_is_waited_for(tiny_edit_model, tmp_path) -> None:
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    (rc0, out0, err0), (rc1, out1, err1) = launch_two(
        "rank_uneven.py", "train-load", str(store), tiny_edit_model, str(tmp_path / "marker"), "5", "12", str(out),
        timeout=400)
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-3000:], err1[-3000:])  # before: rank 0 "Timed out waiting 5000ms"
    assert (out / "lora").is_dir() and (out / "checkpoints" / "step-2").is_dir()
