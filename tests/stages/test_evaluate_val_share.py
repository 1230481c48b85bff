"""`evaluate --all-checkpoints` on two ranks: each rank reads only the val samples whose losses it computes
(`stages/evaluate/val_share.py`). Before, each rank read every val sample (up to 256) to compute half of them:
here 5 samples, 5 reads per rank (10 in all); now 3 + 2, plus on rank 0 the pictured ones of rank 1's half.
The numbers are the one-process numbers, masks included (the report's mask section needs every sample's mask:
sent by the rank that read it); a damaged sample met by rank 1 is left out on both ranks, the next row taken,
as one process does. The three cases run in one two-rank launch (`two_ranks_rows`: each launch costs seconds of
imports per rank), each case compared with its own one-process run."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import xarray as xr
from damage import flip_bit, sample_byte
from test_evaluate_checkpoints import CFG, _ckpts, run_and_store  # noqa: F401 (the module fixture)
from two_ranks import launch_two, results

from schemas.config import EvaluateConfig
from stages.evaluate import checkpoints as ev
from store import Store
from store.loss_array import GROUP


SHARE = {**CFG, "num_samples": 2, "num_inference_steps": 2}
DAMAGED = {**CFG, "on_damaged": "skip", "max_damaged_fraction": 0.5, "max_loss_samples": 3}
FEWER = {**CFG, "max_loss_samples": 1, "num_samples": 1, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def two_ranks_rows(run_and_store, tiny_edit_model, tmp_path_factory) -> dict[str, tuple[list[int], list[int], object]]:
    """Each case's two-rank run, all in one launch: case -> (rank 0's rows read, rank 1's, the report folder).
    The damaged case's store is a copy with joined row 1's target damaged (rank 1 reads it)."""
    root, tmp = run_and_store, tmp_path_factory.mktemp("val-share")
    damaged = tmp / "store"
    shutil.copytree(root / "store", damaged)
    flip_bit(*sample_byte(damaged, "vae", _val_keys(damaged)[1], "target"), 6)
    cases = {"share": (root / "store", SHARE), "damaged": (damaged, DAMAGED), "fewer": (root / "store", FEWER)}
    jobs = [[str(store), str(tmp / name), settings] for name, (store, settings) in cases.items()]
    outs = launch_two("val_share_ranks.py", str(root / "run"), tiny_edit_model, json.dumps(jobs))
    (rc0, out0, err0), (rc1, out1, err1) = outs
    assert rc0 == rc1 == 0, (err0[-3000:], err1[-3000:])
    r0, r1 = results(out0), results(out1)
    return {name: (json.loads(r0[f"rows{i}"]), json.loads(r1[f"rows{i}"]), tmp / name) for i, name in enumerate(cases)}


def _val_keys(store) -> list[str]:
    """The joined val rows' keys in row order (sorted keys of the val split)."""
    from store.join import split_keys

    r = Store(store, create=False).reader("vae")
    keys = split_keys(r, "val")
    r.close()
    return keys


def test_each_rank_reads_its_share_and_the_numbers_are_one_process(run_and_store, two_ranks_rows, tiny_edit_model,
                                                                    tmp_path):
    root = run_and_store
    one = ev.run(EvaluateConfig(**SHARE), root / "store", tiny_edit_model, _ckpts(root), tmp_path / "one")
    rows0, rows1, two_out = two_ranks_rows["share"]
    n = len(_val_keys(root / "store"))
    assert n == 5
    pictured = {s["title"] for s in one.metrics["generation"]["samples"]}
    keys = _val_keys(root / "store")
    extra = sorted(i for i in range(1, n, 2) if keys[i][:12] in pictured)  # rank 1's rows rank 0 pictures
    assert sorted(rows1) == [1, 3]  # before: [0, 1, 2, 3, 4]
    assert sorted(rows0) == sorted([0, 2, 4] + extra)
    a, b = xr.open_zarr(tmp_path / "one" / GROUP), xr.open_zarr(two_out / GROUP)
    assert list(b.sample.values) == list(a.sample.values)
    np.testing.assert_allclose(b.loss.values, a.loss.values, rtol=1e-5, atol=1e-7)
    assert np.array_equal(np.isnan(b.loss.values), np.isnan(a.loss.values))
    two = json.loads((two_out / "metrics.json").read_text())
    # every sample's mask, also those rank 1 read: tokens and mask mass to the bit, the regions' losses alike
    assert two["loss"]["mask"]["per_sample"].keys() == one.metrics["loss"]["mask"]["per_sample"].keys()
    for key, want in one.metrics["loss"]["mask"]["per_sample"].items():
        got = two["loss"]["mask"]["per_sample"][key]
        assert (got["tokens"], got["mask_tokens"]) == (want["tokens"], want["mask_tokens"])
    assert [s["title"] for s in two["generation"]["samples"]] == [s["title"] for s in one.metrics["generation"]["samples"]]
    for got, want in zip(two["generation"]["samples"], one.metrics["generation"]["samples"]):
        assert got.keys() == want.keys()


def test_a_sample_damaged_in_rank_1s_share_is_left_out_on_both_as_one_process_does(run_and_store, two_ranks_rows,
                                                                                  tiny_edit_model, tmp_path):
    root = run_and_store
    rows0, rows1, two_out = two_ranks_rows["damaged"]
    store = two_out.parent / "store"  # joined row 1's target damaged: rank 1 reads it
    keys = _val_keys(store)
    one = ev.run(EvaluateConfig(**DAMAGED), store, tiny_edit_model, _ckpts(root), tmp_path / "one")
    assert sorted(rows0) == [0, 2] and sorted(rows1) == [1, 3]  # row 1 damaged: row 3 read instead
    a, b = xr.open_zarr(tmp_path / "one" / GROUP), xr.open_zarr(two_out / GROUP)
    assert list(a.sample.values) == list(b.sample.values) == [keys[0], keys[2], keys[3]]
    np.testing.assert_allclose(b.loss.values, a.loss.values, rtol=1e-5, atol=1e-7)
    two = json.loads((two_out / "metrics.json").read_text())
    assert list(two["run"]["damaged_samples"]) == list(one.metrics["run"]["damaged_samples"]) == [keys[1]]


def test_fewer_val_samples_than_ranks_rank_1_reads_none_and_the_numbers_are_one_process(run_and_store, two_ranks_rows,
                                                                                       tiny_edit_model, tmp_path):
    """max_loss_samples = 1 on two ranks: rank 1's share is empty (it reads no sample, still reaches every
    collective: the damaged flags, the masks, the loss sums) and the loss array is the one process's."""
    root = run_and_store
    ev.run(EvaluateConfig(**FEWER), root / "store", tiny_edit_model, _ckpts(root), tmp_path / "one")
    rows0, rows1, two_out = two_ranks_rows["fewer"]
    assert rows1 == [] and sorted(set(rows0)) == [0]
    a, b = xr.open_zarr(tmp_path / "one" / GROUP), xr.open_zarr(two_out / GROUP)
    assert list(b.sample.values) == list(a.sample.values) == [_val_keys(root / "store")[0]]
    np.testing.assert_allclose(b.loss.values, a.loss.values, rtol=1e-5, atol=1e-7)
