"""`pipeline compare` on arrays written directly (no model): the runs' bests paired over the val samples they share
that picked neither (how sure "run A beats run B" is, as evaluate states it for its best checkpoint), and arrays
of another evaluation revision refused (their numbers are not one scale)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from schemas.errors import UserError
from stages.evaluate.compare import check_same_held_out, read_curves, write_compare
from store.loss_array import Axes, LossStore

KEYS = [f"{i:032x}" for i in range(6)]


def _settings(revision: int | None = 1) -> dict:
    settings = {"tables": {"text": "content:t", "vae": "content:v"}, "model_fingerprint": "m",
                "evaluate": {"noise_seeds": [0, 1], "timesteps": [0.5], "max_loss_samples": None, "lora_scale": 1.0,
                             "dtype": "float32", "attention_backend": "native", "quantize_base": "none",
                             "on_damaged": "stop"}}
    if revision is not None:  # None: an array recorded before the revision was (revision 1)
        settings["evaluation_revision"] = revision
    return settings


def _array(folder, steps: dict[int, np.ndarray], base: np.ndarray, revision: int | None = 1):
    """A loss array of `steps` (step -> [sample, seed] losses; region all, σ 0.5) over the base `base`."""
    axes = Axes(KEYS, ["16x16"] * len(KEYS), [0, 1], [0.5])

    def grid(values):
        g = np.full(axes.shape, np.nan)
        g[:, :, 0, 0] = values
        return g

    losses = LossStore(folder, f"fp {folder.name}", axes, _settings(revision))
    losses.write_base(grid(base))
    for step, values in steps.items():
        losses.append(step, str(folder / f"step-{step}"), f"sha {step}", grid(values))
    return folder


def test_an_array_of_another_evaluation_revision_is_refused(tmp_path):
    """EVALUATION_REVISION is bumped by a release that changes the numbers for the same inputs: evaluate keeps such
    an array aside, and compare must not draw it beside one of this revision as if on one scale (it compared
    them: the revision was not among what makes two held-out sets one)."""
    rng = np.random.default_rng(0)
    base = rng.uniform(1, 2, (6, 2))
    old = read_curves(_array(tmp_path / "old", {10: base * 0.9}, base, revision=None), "old")
    now = read_curves(_array(tmp_path / "now", {10: base * 0.8}, base, revision=1), "now")
    check_same_held_out([old, now])  # unrecorded = revision 1: the same
    later = read_curves(_array(tmp_path / "later", {10: base * 0.8}, base, revision=2), "later")
    with pytest.raises(UserError, match=r"evaluation revision \(1 vs 2\)"):
        check_same_held_out([now, later])


def _per_sample(values: np.ndarray) -> np.ndarray:
    return values.mean(axis=1)  # a sample's seeds x σ rows averaged, as evaluate pairs them


def test_each_runs_best_is_paired_with_the_best_runs_over_the_val_samples(tmp_path):
    """Two runs on one held-out set, their bests 0.02 apart in the mean but with a spread across samples: compare
    says by how much each run's best trails the best run's, paired sample by sample ± its standard error (the same
    numbers as `paired`, checked here against numpy), so a difference within about two standard errors is seen as
    one the held-out set does not tell apart. Before, it listed each run's best loss alone."""
    rng = np.random.default_rng(1)
    base = rng.uniform(1, 2, (6, 2))
    a_best = base * 0.8 + rng.normal(0, 0.05, base.shape)
    b_best = a_best + 0.02 + rng.normal(0, 0.03, base.shape)
    a = _array(tmp_path / "a", {10: base * 0.9, 20: a_best}, base)
    b = _array(tmp_path / "b", {10: b_best, 20: base * 0.95}, base)
    result = write_compare([str(a), str(b)], tmp_path / "cmp")

    # over the 3 samples that picked neither best (sha256 order of the keys: odd positions confirm), as evaluate
    # states its best checkpoint: the bests' own selecting samples flatter them
    order = sorted(range(len(KEYS)), key=lambda i: hashlib.sha256(KEYS[i].encode()).hexdigest())
    d = (_per_sample(b_best) - _per_sample(a_best))[sorted(order[1::2])]
    record = result.to_json()["runs"]
    assert record[0]["vs_best_run"] is None  # a is the best run
    vs = record[1]["vs_best_run"]
    assert vs["run"] == "a" and vs["n"] == 3
    # the array holds float32: about 1e-7 of a loss near 1.5
    assert vs["difference"] == pytest.approx(d.mean(), abs=1e-6)
    assert vs["standard_error"] == pytest.approx(d.std(ddof=1) / math.sqrt(3), abs=1e-6)
    line = str(result)
    assert f"b {vs['difference']:+.4f} ± {vs['standard_error']:.4f}" in line and "paired over 3 val samples" in line
    page = (tmp_path / "cmp" / "index.html").read_text()
    assert f"{vs['difference']:+.4f} ± {vs['standard_error']:.4f}" in page


def test_a_sample_left_out_of_one_run_is_left_out_of_the_pairing(tmp_path):
    """A sample one run leaves out (its base non-finite: evaluate.on_nonfinite=skip) is paired in neither: the
    difference is over the samples both runs' numbers hold."""
    rng = np.random.default_rng(2)
    base = rng.uniform(1, 2, (6, 2))
    bad = base.copy()
    bad[0] = np.nan
    a_best, b_best = base * 0.8, base * 0.85
    a = _array(tmp_path / "a", {10: a_best}, base)
    b = _array(tmp_path / "b", {10: b_best}, bad)
    vs = write_compare([str(b), str(a)], tmp_path / "cmp").to_json()["runs"][0]["vs_best_run"]
    d = (_per_sample(b_best) - _per_sample(a_best))[1:]
    assert vs["n"] == 5 and vs["difference"] == pytest.approx(d.mean(), rel=1e-6)


def test_a_path_that_does_not_exist_is_named_as_such(tmp_path):
    """A mistyped report path was told as a folder holding no losses.zarr ("no losses.zarr there (nor in
    X/evaluate-report)"), as if the folder were there."""
    from stages.evaluate.compare import find_group

    with pytest.raises(UserError, match=f"^{tmp_path / 'typo'} does not exist; pass a report folder"):
        find_group(tmp_path / "typo")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no losses.zarr there"):
        find_group(tmp_path / "empty")


def test_the_best_run_is_picked_on_the_same_samples_for_every_run(tmp_path):
    """A run of one checkpoint picks nothing (its best's loss is over every sample) while a run of two picks on its
    selecting half: the best run must still be picked on one set of samples for both. Here the selecting half is
    the harder one and run a is better than run b by 0.5 on every sample; picking the best run by a's selecting
    loss (9.0) against b's loss over every sample (5.0) named b, which every sample says is worse."""
    order = sorted(range(len(KEYS)), key=lambda i: hashlib.sha256(KEYS[i].encode()).hexdigest())
    base = np.ones((6, 2))
    base[sorted(order[0::2])] = 10.0  # the selecting half: the hard samples
    base += np.random.default_rng(3).normal(0, 0.01, base.shape)
    a = _array(tmp_path / "a", {10: base - 1.0, 20: base - 0.2}, base)
    b = _array(tmp_path / "b", {10: base - 0.5}, base)
    record = write_compare([str(b), str(a)], tmp_path / "cmp").to_json()["runs"]
    assert record[1]["vs_best_run"] is None, record  # a is the best run
    vs = record[0]["vs_best_run"]
    assert vs["run"] == "a" and vs["difference"] == pytest.approx(0.5, abs=1e-5) and vs["n"] == 3
