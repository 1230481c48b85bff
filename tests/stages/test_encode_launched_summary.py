"""`pipeline launch ... run encode-text|encode-vae` on its own (outside `run all`) printed one precision line and
one `[rank r/N]` summary per rank, each counting its own share, and the damaged samples the summary named were
rank 0's only. Now both ranks sum their counts and damaged samples (`stages.encode.summary.over_ranks`, the one
mechanism `run all` uses too) and rank 0 alone prints (`pipeline/rank_output.py`). Two gloo processes on the
CPU through the CLI's own entry point (tests/stages/rank_cli.py), one damaged sample in each rank's share."""

from __future__ import annotations

import pytest

from two_ranks import launch_two


@pytest.mark.parametrize("stage,table", [("encode-text", "text"), ("encode-vae", "vae")])
def test_a_launched_encode_prints_once_with_every_ranks_counts_and_damage(tiny_edit_model, edit_store,
                                                                          stage, table) -> None:
    from damage import flip_bit, sample_byte
    from store import Store

    with Store(edit_store).reader("images") as images:
        keys = images.keys()
        damaged = [images.iter_keys(rank=r, world_size=2)[0] for r in (0, 1)]  # one in each rank's share
    for key in damaged:
        flip_bit(*sample_byte(edit_store, "images", key), 2)
    section = stage.replace("-", "_")
    (rc0, out0, err0), (rc1, out1, err1) = launch_two(
        "rank_cli.py", "run", stage, "--store", str(edit_store), "--model", tiny_edit_model, "--device", "cpu",
        "--set", f"{section}.on_damaged=skip", "--set", f"{section}.max_damaged_fraction=0.5", timeout=300)
    assert rc0 == rc1 == 0, (err0[-3000:], err1[-3000:])
    assert out1 == "", out1  # rank 1's lines go nowhere: rank 0's say it all
    lines = out0.splitlines()
    assert sum(line.startswith(f"{stage}: float32 on cpu") for line in lines) == 1, out0
    summaries = [line for line in lines if line.startswith(f"{stage} [")]
    assert summaries == [line for line in lines if line.startswith(f"{stage} [2 ranks]: table '{table}' v1: "
                                                                   f"encoded {len(keys) - 2}, ")], out0
    assert len(summaries) == 1, out0
    skipped = next(line for line in lines if line.startswith("skipped "))
    assert skipped.startswith("skipped 2 damaged input sample(s)") and all(k in skipped for k in damaged), out0
    with Store(edit_store).reader(table) as out:
        assert sorted(out.keys()) == sorted(set(keys) - set(damaged))


def test_a_launched_encode_whose_every_sample_is_rejected_fails_on_both_ranks_and_leaves_no_version(
        tiny_edit_model, tmp_path, images_fixture) -> None:
    """Rank 0 finds the version empty and removes it (every rank done and waiting at the commit's agreement): both
    ranks end with its one line, and no version folder is left (it was: v1 with both ranks' done files)."""
    store = tmp_path / "store"
    # an Edit model needs exactly one control: every sample is rejected, on both ranks
    images_fixture.write(store, [images_fixture.Sample(f"two {i}", (64, 64), [(64, 64)] * 2, [(64, 64)] * 2)
                                 for i in range(4)])
    (rc0, out0, err0), (rc1, out1, err1) = launch_two(
        "rank_cli.py", "run", "encode-text", "--store", str(store), "--model", tiny_edit_model, "--device", "cpu",
        timeout=300)
    assert rc0 != 0 and rc1 != 0, (out0, out1)
    assert "would be empty" in err0 + out0 and "Traceback" not in err0 + err1, (err0[-3000:], err1[-3000:])
    assert not list((store / "text").glob("v*")) and not list((store / "text").glob(".v*"))
