"""`cell_donor`: the group of another seed / σ grid whose shared (seed, σ) cells a grown or shrunk grid takes
instead of computing them."""

from __future__ import annotations

import numpy as np

from store.loss_array import GROUP, Axes, LossStore, cell_donor
from test_loss_array import _previous_release

AXES = Axes(["k1", "k2"], ["32x32", "32x32"], [0, 1], [0.25, 0.75])


def _settings(seeds: list[int]) -> dict:
    return {"tables": {"text": "t", "vae": "v"}, "evaluate": {"noise_seeds": seeds, "timesteps": [0.25, 0.75]}}


def test_a_previous_release_group_gives_no_cell_of_a_row_whose_chunk_is_absent(tmp_path, monkeypatch):
    """Format 1 (an earlier release) wrote no chunk that was all NaN, so an absent chunk is a lost file or a
    non-finite row, which nothing can tell apart. Taken as a donor's cells, that NaN went into the new group
    (format 2, every chunk written) as checked numbers: evaluate.on_nonfinite=stop named the val samples as bad
    features, or the step passed for a non-finite checkpoint. Such rows (and such a base) are computed instead;
    the others are still taken."""
    _previous_release(monkeypatch)
    s = LossStore(tmp_path, "fp01", AXES, _settings([0, 1]))
    s.write_base(np.full(AXES.shape, 2.0))
    s.append(10, "ckpt-10", "sha10", np.full(AXES.shape, 1.0))
    s.append(20, "ckpt-20", "sha20", np.full(AXES.shape, np.nan))  # no chunk written for it
    s.append(30, "ckpt-30", "sha30", np.full(AXES.shape, 3.0))
    monkeypatch.undo()
    (tmp_path / GROUP / "base_loss" / "c" / "0" / "0" / "0" / "0").unlink()  # a file lost later

    donor = cell_donor(tmp_path, _settings([0, 1, 2]), [0, 1, 2], AXES.sigmas, AXES.keys, True,
                       {10: "sha10", 20: "sha20", 30: "sha30"})
    assert donor is not None and donor.known[:2].all() and not donor.known[2].any()
    assert donor.holds(10, "sha10") and donor.holds(30, "sha30")
    assert not donor.holds(20, "sha20") and not donor.has_base()
    np.testing.assert_array_equal(donor.step(30, np.full((2, 3, 2, 3), 7.0))[:, :2], 3.0)


def _kept(folder, name: str, seeds: list[int], steps: list[int]) -> None:
    """A group of seeds `seeds` with the base and `steps` (sha "sha<step>"), kept aside in `folder` as `name`."""
    axes = Axes(AXES.keys, AXES.buckets, seeds, AXES.sigmas)
    s = LossStore(folder / f"make-{name}", f"fp-{name}", axes, _settings(seeds))
    s.write_base(np.full(axes.shape, 2.0))
    for step in steps:
        s.append(step, f"ckpt-{step}", f"sha{step}", np.full(axes.shape, float(step)))
    (folder / f"make-{name}" / GROUP).rename(folder / name)


def test_the_donor_is_the_group_that_saves_this_plan_the_most_cells(tmp_path, monkeypatch):
    """Two groups kept aside: seeds [0, 1, 2] with one checkpoint, [0, 1] with the plan's three. The grid grows to
    [0, 1, 2, 3]: the first gives 6 cells to the base and one checkpoint (12), the second 4 cells to the base and
    three checkpoints (16 cells, 12 forwards per sample fewer than computing them). It took the first (the most
    cells shared, whatever rows the plan needed), and read every candidate whole on each plan; now it weighs
    them by their index and reads only the one picked, the next taken where that one is damaged."""
    import store.loss_array as la

    _kept(tmp_path, "losses.aaaaaaaaaaaa.zarr", [0, 1, 2], [10])
    _kept(tmp_path, "losses.bbbbbbbbbbbb.zarr", [0, 1], [10, 20, 30])
    plan = {10: "sha10", 20: "sha20", 30: "sha30"}
    read, real = [], la._verify
    monkeypatch.setattr(la, "_verify", lambda group, path: (read.append(path.name), real(group, path))[1])
    donor = cell_donor(tmp_path, _settings([0, 1, 2, 3]), [0, 1, 2, 3], AXES.sigmas, AXES.keys, True, plan)
    assert donor.path.name == "losses.bbbbbbbbbbbb.zarr" and donor.saves(True, plan) == 16
    assert read == ["losses.bbbbbbbbbbbb.zarr"]  # the other group's losses never read
    # a plan of checkpoint 10 alone (its base recorded): 6 cells from the first, 4 from the second
    assert cell_donor(tmp_path, _settings([0, 1, 2, 3]), [0, 1, 2, 3], AXES.sigmas, AXES.keys, False,
                      {10: "sha10"}).path.name == "losses.aaaaaaaaaaaa.zarr"
    # nothing the plan needs held anywhere (other bytes): no donor
    assert cell_donor(tmp_path, _settings([0, 1, 2, 3]), [0, 1, 2, 3], AXES.sigmas, AXES.keys, False,
                      {10: "other"}) is None
    # the best one damaged (a flipped byte in a chunk of its losses): the next best, checked whole
    chunk = next(p for p in (tmp_path / "losses.bbbbbbbbbbbb.zarr" / "loss").rglob("*") if p.is_file()
                 and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    read.clear()
    donor = cell_donor(tmp_path, _settings([0, 1, 2, 3]), [0, 1, 2, 3], AXES.sigmas, AXES.keys, True, plan)
    assert donor.path.name == "losses.aaaaaaaaaaaa.zarr" and read == ["losses.bbbbbbbbbbbb.zarr",
                                                                      "losses.aaaaaaaaaaaa.zarr"]
