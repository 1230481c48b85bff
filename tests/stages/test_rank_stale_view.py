"""`--resume` on two ranks that do not see the same run folder (rank 1's listing lags one checkpoint behind, as
a shared filesystem's directory cache can right after a restart): every rank stops before loading anything, with
the same one line naming the folder, instead of rank 0 resuming at step 4 and rank 1 at step 2 (different
optimizer states and data positions, then collectives that no longer pair up: a hang or a gloo error)."""

from __future__ import annotations

from pipeline.config import load_config
from stages.train import state as train_state
from stages.train.recipe import run
from train_store import make_train_store, mixed_specs
from two_ranks import launch_two


def test_ranks_that_see_different_checkpoints_stop_with_one_line(tiny_edit_model, tmp_path) -> None:
    store, out = tmp_path / "store", tmp_path / "run"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    run(load_config(None, {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.max_steps": 4,
                           "train.checkpoint_every": 2}), store, tiny_edit_model, out)
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [2, 4]

    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", str(store), tiny_edit_model, str(out), "6",
                                                      timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 1, (rc0, rc1, err0[-2000:], err1[-2000:])
    last0, last1 = err0.strip().splitlines()[-1], err1.strip().splitlines()[-1]
    assert last0 == last1, (last0, last1)
    assert f"the ranks do not see the same run folder {out}" in last0 and "step-4 on some, step-2 on others" in last0
    assert [s for s, _ in train_state.complete_checkpoints(out / "checkpoints")] == [2, 4]  # nothing trained on
