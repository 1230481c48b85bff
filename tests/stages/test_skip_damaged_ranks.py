"""train.on_damaged=skip on two gloo processes, with no pass over the split before step 0: the rank that meets
the damaged sample leaves it out of its batch and still runs its forward and backward, so neither rank hangs
or falls out of step; the damaged count rides on the loss all-reduce, so both ranks train the LoRA one process
trains on the same global batches, and both stop at the same step with the same line over the limit."""

from __future__ import annotations


from damage import flip_bit, sample_byte
from models.lora import read_lora
from pipeline.config import load_config
from stages.train import damaged_log
from stages.train.recipe import run
from train_store import assert_close_lora, key_of, make_train_store, mixed_specs
from two_ranks import launch_two, results

def test_two_ranks_skip_a_damaged_sample_together(tiny_edit_model, tmp_path) -> None:
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    key = key_of(3)
    flip_bit(*sample_byte(store, "vae", key, "target"), 6)

    outs = launch_two("skip_damaged_ranks.py", str(store), tiny_edit_model, str(tmp_path / "out"))
    (rc0, out0, err0), (rc1, out1, err1) = outs
    assert rc0 == rc1 == 0, (err0[-3000:], err1[-3000:])
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    r0, r1 = results(out0), results(out1)
    assert r0 == r1 and r0["ok"] == "steps 2", (r0, r1)
    # one rank met it (one epoch: each sample in one rank's share), in both runs
    met = [out for out in (out0, out1) if f"left out damaged sample(s) {key}" in out]
    assert len(met) == 1 and met[0].count(f"left out damaged sample(s) {key}") == 2, (out0, out1)
    assert "max_damaged_fraction = 0.0" in r0["limit"] and "damaged_samples.jsonl" in r0["limit"], r0
    for case in ("ok", "limit"):
        assert list(damaged_log.read(tmp_path / "out" / case)) == [key]
    assert not (tmp_path / "out" / "limit" / "lora").exists()

    # the same global batches on one process (batch 2 x 2 ranks = batch 4): the same LoRA
    run(load_config(None, {"train.device": "cpu", "train.batch_size": 4, "train.lora.rank": 4,
                                 "train.learning_rate": 2e-3, "train.sigma.sampling": "uniform",
                                 "train.max_steps": 2, "train.on_damaged": "skip",
                                 "train.max_damaged_fraction": 0.2}), store, tiny_edit_model, tmp_path / "one")
    assert_close_lora(read_lora(tmp_path / "one" / "lora")[0], read_lora(tmp_path / "out" / "ok" / "lora")[0],
                      lr=2e-3, steps=2)


def test_a_step_of_damaged_samples_only_is_said_once_and_counted_as_such(tiny_edit_model, tmp_path) -> None:
    """Two ranks, one sample each per step, 6 of 8 samples damaged: of the 4 steps, at least 2 hold no intact
    sample (the 2 intact ones cover 2 at most). Each such step's line was printed by every rank, and the summary
    counted it as a non-finite step skipped; now rank 0 says it once and the summary names it."""
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))
    for i in range(2, 8):
        flip_bit(*sample_byte(store, "vae", key_of(i), "target"), 6)

    (rc0, out0, err0), (rc1, out1, err1) = launch_two("damaged_steps_ranks.py", str(store), tiny_edit_model,
                                                      str(tmp_path / "out"))
    assert rc0 == rc1 == 0, (err0[-3000:], err1[-3000:])
    r0 = results(out0)
    steps = [int(s) for s in r0["damaged_steps"].strip("[]").split(",")]
    assert len(steps) >= 2, r0
    said = [out.count(f"optimizer step {s}: every sample damaged") for out in (out0 + err0, out1 + err1)
            for s in steps]
    assert said == [1] * len(steps) + [0] * len(steps), (out0, out1)
    assert f"{len(steps)} step(s) with every sample damaged, no update" in r0["line"] and \
        "non-finite" not in r0["line"], r0
