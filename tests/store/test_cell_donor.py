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

    donor = cell_donor(tmp_path, _settings([0, 1, 2]), [0, 1, 2], AXES.sigmas, AXES.keys)
    assert donor is not None and donor.known[:2].all() and not donor.known[2].any()
    assert donor.holds(10, "sha10") and donor.holds(30, "sha30")
    assert not donor.holds(20, "sha20") and not donor.has_base()
    np.testing.assert_array_equal(donor.step(30, np.full((2, 3, 2, 3), 7.0))[:, :2], 3.0)
