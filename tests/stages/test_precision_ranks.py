"""`train.dtype: auto` is one decision of all ranks (models/precision.py `agreed_precision`): rank 0 resolves it to
bfloat16 (a GPU with native bf16), rank 1 to float32 (one without; tests/stages/precision_ranks.py), and both
ranks train the one DDP model with a float32 base and no autocast, the widest precision every rank can run; the
run's precision.json and the precision line say why, and train_config.yaml records float32. Before, each rank
resolved its own and the ranks' config fingerprints differed: every rank stopped ("the ranks do not train with
the same settings"), and a stage that does not compare them (evaluate --all-checkpoints) mixed precisions."""

from __future__ import annotations

import json

import yaml

from train_store import make_train_store, mixed_specs
from two_ranks import launch_two, results


def test_ranks_that_resolve_auto_differently_train_in_the_precision_every_rank_can_run(tiny_edit_model,
                                                                                        tmp_path) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    make_train_store(store, tiny_edit_model, mixed_specs(4))
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("precision_ranks.py", str(store), tiny_edit_model, str(out))
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-3000:], err1[-3000:])
    # every step of both ranks: a float32 base, no bf16 autocast
    assert results(out0)["trained"] == results(out1)["trained"] == "torch.float32 no", (out0, out1)
    config = yaml.safe_load((out / "train_config.yaml").read_text())["train"]
    assert (config["dtype"], config["mixed_precision"]) == ("float32", "no")
    record = json.loads((out / "precision.json").read_text())
    assert (record["weights"], record["autocast_bf16"], record["requested"]) == ("float32", False, "auto")
    assert record["reason"] == ("all 2 ranks run float32, the best precision every rank can run (bfloat16 on "
                                "rank(s) 0 only): rank 1: auto: float32, cpu has no native bf16 (emulated on a CPU)")
    assert [(r["rank"], r["dtype"]) for r in record["ranks"]] == [(0, "bfloat16"), (1, "float32")]
    said = [line for line in (err0 + err1 + out0 + out1).splitlines() if line.startswith("train (frozen base):")]
    assert said == [f"train (frozen base): float32 on cpu (auto); {record['reason']}"], said
