"""The default attention backend is one decision of all ranks (models/attention.py `agree`): the packed probe
passes on rank 0 and fails on rank 1 (tests/stages/attention_probe_ranks.py), and both ranks train the one DDP
model with native SDPA, the best backend both can run; the run's attention.json says so, with each rank's own
probe and pick and rank 1's error. Before, each rank took its own probe's pick: rank 0 trained with packed,
rank 1 with native, and the record (rank 0's) said packed."""

from __future__ import annotations

import json

from train_store import make_train_store, mixed_specs
from two_ranks import launch_two, results


def test_ranks_whose_probes_differ_all_run_the_backend_every_rank_can(tiny_edit_model, tmp_path) -> None:
    store, out = tmp_path / "store", tmp_path / "out"
    make_train_store(store, tiny_edit_model, mixed_specs(4))  # mixed sizes: padded batches, the masked kernels
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("attention_probe_ranks.py", str(store), tiny_edit_model,
                                                      str(out))
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-3000:], err1[-3000:])
    r0, r1 = results(out0), results(out1)
    assert r0["backend"] == r1["backend"] == "native", (r0["backend"], r1["backend"])
    record = json.loads((out / "attention.json").read_text())
    assert json.loads(r0["record"])["reason"] == json.loads(r1["record"])["reason"] == record["reason"]
    assert record["backend"] == "native"
    assert record["reason"].startswith("all 2 ranks run native, the best backend every rank can run (packed on "
                                       "rank(s) 0 only): rank 1: packed probe failed"), record["reason"]
    assert "no varlen kernel here (rank 1, injected)" in record["reason"], record["reason"]
    # what each rank probed and picked on its own
    assert [(r["rank"], r["backend"], r["probe"]["ok"]) for r in record["ranks"]] == [(0, "packed", True),
                                                                                      (1, "native", False)]
    assert "injected" in record["ranks"][1]["probe"]["error"]
    # said once, by rank 0, with the reason
    said = [line for line in (err0 + err1).splitlines() if "train.attention_backend:" in line]
    assert said == [f"train.attention_backend: native ({record['reason']})"], said
