"""LoRA dropout on several ranks: each rank draws its own masks. Every rank seeds the global RNG with
`train.seed` to build the same LoRA; left like that, every rank drew the same dropout masks in step after step
(the same positions dropped in every rank's samples: 1/world of the dropout noise a process with the whole
batch gets). Two gloo processes, the tiny model, one step."""

from __future__ import annotations

from train_store import make_train_store, mixed_specs
from two_ranks import launch_two, results


def test_ranks_draw_lora_dropout_from_streams_of_their_own(tiny_edit_model, tmp_path) -> None:
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(4))
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_dropout_rng.py", str(store), tiny_edit_model,
                                                      str(tmp_path / "run"))
    assert rc0 == rc1 == 0, (err0[-3000:], err1[-3000:])
    assert results(out0)["rng"] != results(out1)["rng"]
