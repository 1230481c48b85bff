"""How sure "best" is: the report states the best checkpoint's difference to the base and to the next best
checkpoint, paired over the val samples that did not pick it (every checkpoint sees the same noise and σ; the
halves: `stages.evaluate.selection`), with its standard error; checked against scipy's paired t-test
(`scipy.stats.ttest_rel`: t = mean difference / standard error)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr
from scipy import stats

from schemas.config import EvaluateConfig
from stages.evaluate import checkpoints as ev
from stages.evaluate.paired import signed
from store.loss_array import GROUP
from test_evaluate_checkpoints import CFG, _ckpts, _own_run, run_and_store  # noqa: F401 (the module fixture)


def _per_sample(grid: np.ndarray) -> np.ndarray:
    return grid[..., 0].mean(axis=(1, 2))


def _halves(group) -> tuple[np.ndarray, np.ndarray]:
    """(selecting, confirming) masks over the array's samples: the first 3 of the 5 keys by sha256 order pick the
    best (positions 0, 2, 4), the other 2 confirm it (`stages.evaluate.selection`)."""
    import hashlib

    keys = [str(k) for k in group["sample"][:]]
    order = sorted(range(len(keys)), key=lambda i: hashlib.sha256(keys[i].encode()).hexdigest())
    select = np.zeros(len(keys), dtype=bool)
    select[order[0::2]] = True
    return select, ~select


def _offsets(confirm: np.ndarray, on_confirm: list[float], on_select: list[float]) -> np.ndarray:
    """[sample] offsets from the base: `on_confirm` on the confirming samples, `on_select` on the selecting ones."""
    out = np.zeros(confirm.size)
    out[confirm], out[~confirm] = on_confirm, on_select
    return out


def test_best_checkpoint_states_its_paired_difference_to_base_and_runner_up(run_and_store, tiny_edit_model,
                                                                            tmp_path):
    root, out = run_and_store, tmp_path / "report"
    ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    group = zarr.open_group(out / GROUP, mode="r+", use_consolidated=True)
    base = np.asarray(group["base_loss"][:], dtype=np.float64)
    rng = np.random.default_rng(0)
    # step 10 a little better than the base on average, by a different amount per sample; 20 and 30 = the base
    better = base * (1 - 0.05 * rng.random((base.shape[0], 1, 1, 1)))
    row = {int(s): i for i, s in enumerate(group["step"][:])}  # evaluate appends the newest step first
    group["loss"][row[10]] = better.astype("float32")

    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    best = res.best
    assert best["step"] == 10 and best["runner_up"]["step"] == 20  # 20 and 30 tie: the earlier one
    b10 = _per_sample(np.asarray(group["loss"][row[10]], dtype=np.float64))
    b20 = _per_sample(np.asarray(group["loss"][row[20]], dtype=np.float64))
    b0 = _per_sample(np.asarray(group["base_loss"][:], dtype=np.float64))
    select, confirm = _halves(group)
    # stated over the 2 val samples that took no part in the pick, not the 5 (of which 3 picked it)
    for got, (a, b) in ((best["vs_base"], (b10, b0)), (best["runner_up"], (b20, b10))):
        a, b = a[confirm], b[confirm]
        t = stats.ttest_rel(a, b).statistic
        assert got["n"] == 2
        assert got["difference"] == pytest.approx(np.mean(a - b), rel=1e-9)
        assert got["standard_error"] == pytest.approx(np.mean(a - b) / t, rel=1e-9)
    c = res.metrics["checkpoints"]
    keys = [str(k) for k in group["sample"][:]]
    assert sorted(c["selection"]["selected_on"]) == sorted(k for k, here in zip(keys, select) if here)
    assert sorted(c["selection"]["confirmed_on"]) == sorted(k for k, here in zip(keys, confirm) if here)
    assert c["per_step"][0]["selecting"] == pytest.approx(b10[select].mean(), rel=1e-6)
    assert best["runner_up"]["difference"] > 0

    line = str(res)
    assert (f"vs base {best['vs_base']['difference']:+.4f} ± {best['vs_base']['standard_error']:.4f} over 2 val "
            f"samples that did not pick it (the other 3 did): {best['verdict']}") in line
    assert "next best step 20" in line
    j = res.to_json()
    assert j["runner_up"]["step"] == 20 and j["best_vs_base"] == best["vs_base"]
    assert j["best_verdict"] == best["verdict"] and j["selection"] == {
        "how": "split", "selected_on": 3, "confirmed_on": 2, "optimistic": False}
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["checkpoints"]["best"]["runner_up"]["standard_error"] == pytest.approx(
        best["runner_up"]["standard_error"])
    assert metrics["loss"]["lora_minus_base"] == pytest.approx(best["vs_base"])
    page = (out / "index.html").read_text()
    assert "next best, step 20" in page and "over 2 val samples that did not pick it (the other 3 did)" in page
    assert "loss on the samples that pick" in page

    # a report written before these numbers (no vs_base, runner_up, lora_minus_base), still up to date: its summary
    # and --json say nothing of them rather than failing, and its page renders without them
    from stages.evaluate.checkpoint_report import make_grid, render_html

    for key in ("vs_base", "runner_up"):
        del metrics["checkpoints"]["best"][key]
    del metrics["loss"]["lora_minus_base"]
    metrics.pop("checksum", None)  # edited by hand: unsealed, as a report of an earlier release
    (out / "metrics.json").write_text(json.dumps(metrics))
    old = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out, skip_if_done=True)
    assert old.up_to_date and "vs base" not in str(old) and "best checkpoint step 10: held-out loss" in str(old)
    assert old.to_json()["best_vs_base"] is None and old.to_json()["runner_up"] is None
    assert "next best" not in render_html(metrics, [], make_grid([]))


def test_single_lora_evaluate_states_lora_minus_base_paired(run_and_store, tiny_edit_model, tmp_path):
    from stages.evaluate import stage

    lora = _ckpts(run_and_store)[0][1]  # the far LoRA: clearly not the base
    res = stage.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, lora, tmp_path / "r")
    loss = res.metrics["loss"]
    keys = list(loss["per_sample"])
    lora_s = np.array([loss["per_sample"][k]["lora"] for k in keys])
    base_s = np.array([loss["per_sample"][k]["base"] for k in keys])
    got = loss["lora_minus_base"]
    assert got["n"] == len(keys) == 5
    assert got["difference"] == pytest.approx(loss["overall"]["lora"] - loss["overall"]["base"], rel=1e-9)
    assert got["standard_error"] == pytest.approx(got["difference"] / stats.ttest_rel(lora_s, base_s).statistic,
                                                  rel=1e-9)
    assert f"{got['difference']:+.4f} ± {got['standard_error']:.4f}" in str(res)
    assert "paired over the 5 val samples" in (tmp_path / "r" / "index.html").read_text()


def test_one_val_sample_has_no_standard_error_and_the_json_stays_strict():
    import json as strict

    from stages.evaluate.paired import paired, signed

    p = paired(np.array([1.25]), np.array([1.0]))
    assert p == {"difference": 0.25, "standard_error": None, "n": 1} and signed(p) == "+0.2500"
    strict.dumps(p, allow_nan=False)  # no NaN token in --json
    assert signed(paired(np.array([1.0, 2.0]), np.array([0.0, 0.0]))) == "+1.5000 ± 0.5000"


def test_every_checkpoint_within_noise_of_the_best_is_named_not_only_the_next_best(run_and_store, tiny_edit_model,
                                                                                  tmp_path):
    """The next best by mean can be told apart from the best (+0.010 ± 0.0003) while a later-ranked one cannot
    (+0.020 ± 0.035): each step's difference to the best, paired ± s.e. (numpy by hand), and the steps within two
    standard errors named in the line, --json, metrics.json and the page. Before, only the runner-up was stated,
    and "best" read as settled."""
    root, out = run_and_store, tmp_path / "report"
    ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    group = zarr.open_group(out / GROUP, mode="r+", use_consolidated=True)
    base = np.asarray(group["base_loss"][:], dtype=np.float64)
    row = {int(s): i for i, s in enumerate(group["step"][:])}
    # per-sample offsets from the base (every seed x σ row of a sample moved alike): 20 is the base (the best);
    # on the confirming samples 10 is worse on average within noise, 30 the next best told apart
    _, confirm = _halves(group)
    offsets = {10: _offsets(confirm, [0.02 - 0.1, 0.02 + 0.1], [0.02 - 0.05, 0.02 + 0.05, 0.02]),
               20: np.zeros(5),
               # 100 s.e.: told apart over the 2 confirming samples (Student's t: beyond 14.0 s.e.)
               30: _offsets(confirm, [0.01 + 0.0001, 0.01 - 0.0001], [0.01, 0.01, 0.01])}
    for step, off in offsets.items():
        group["loss"][row[step]] = (base + off[:, None, None, None]).astype("float32")

    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    assert res.best["step"] == 20 and res.best["runner_up"]["step"] == 30
    best = _per_sample(np.asarray(group["loss"][row[20]], dtype=np.float64))
    per_step = res.metrics["checkpoints"]["per_step"]  # in step order: 10, 20, 30
    assert per_step[1]["vs_best"] is None
    for i, step in ((0, 10), (2, 30)):
        d = (_per_sample(np.asarray(group["loss"][row[step]], dtype=np.float64)) - best)[confirm]
        got = per_step[i]["vs_best"]
        assert got["n"] == 2 and got["difference"] == pytest.approx(d.mean(), rel=1e-9)
        assert got["standard_error"] == pytest.approx(d.std(ddof=1) / np.sqrt(2), rel=1e-9)
    assert per_step[0]["vs_best"]["difference"] < 2 * per_step[0]["vs_best"]["standard_error"]  # 10: noise
    assert per_step[2]["vs_best"]["difference"] > 2 * per_step[2]["vs_best"]["standard_error"]  # 30: told apart

    assert res.best["within_noise"] == [{"step": 10, "weights": "lora"}]
    assert "not told apart from it (within 14.0 s.e.): step 10 (paired ± s.e.)" in str(res)  # t over 2 samples
    assert res.to_json()["within_noise_of_best"] == [{"step": 10, "weights": "lora"}]
    assert json.loads((out / "metrics.json").read_text())["checkpoints"]["best"]["within_noise"] == [
        {"step": 10, "weights": "lora"}]
    page = (out / "index.html").read_text()
    assert "vs best (paired over the confirming samples ± s.e.)" in page and "not told apart from it: step 10" in page
    assert page.count("≈ best") == 1 and f"{signed(per_step[0]['vs_best'])} ≈ best" in page


def test_a_deleted_checkpoint_better_than_the_best_is_not_marked_as_within_noise(run_and_store, tiny_edit_model,
                                                                                  tmp_path):
    """Step 10, deleted since, was better than the best still on disk (-0.050 ± 0.0003): the table marked it
    "≈ best" (the signed difference is below two standard errors). Only a step on disk within noise either way
    (30) is marked, as the summary names only those; a deleted one within noise is no alternative either."""
    import shutil

    from stages.evaluate.checkpoint_report import make_grid, render_html

    root, out = run_and_store, tmp_path / "report"
    copies = _own_run(root, tmp_path)
    ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, copies, out)
    group = zarr.open_group(out / GROUP, mode="r+", use_consolidated=True)
    base = np.asarray(group["base_loss"][:], dtype=np.float64)
    row = {int(s): i for i, s in enumerate(group["step"][:])}
    _, confirm = _halves(group)
    offsets = {10: _offsets(confirm, [-0.05 + 0.0005, -0.05 - 0.0005], [-0.05] * 3),  # better, told apart
               20: np.zeros(5),
               30: _offsets(confirm, [0.001 - 0.1, 0.001 + 0.1], [0.001 - 0.05, 0.001 + 0.05, 0.001])}  # within noise
    for step, off in offsets.items():
        group["loss"][row[step]] = (base + off[:, None, None, None]).astype("float32")
    shutil.rmtree(copies[0][1].parent)

    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, copies[1:], out)
    per_step = res.metrics["checkpoints"]["per_step"]
    assert res.best["step"] == 20 and per_step[0]["vs_best"]["difference"] == pytest.approx(-0.05, abs=1e-4)
    assert res.best["within_noise"] == [{"step": 30, "weights": "lora"}]
    page = (out / "index.html").read_text()
    assert page.count("≈ best") == 1 and f"{signed(per_step[2]['vs_best'])} ≈ best" in page

    metrics = json.loads((out / "metrics.json").read_text())
    metrics["checkpoints"]["per_step"][0]["vs_best"] = {"difference": -0.0005, "standard_error": 0.001, "n": 2}
    assert render_html(metrics, [], make_grid([])).count("≈ best") == 1  # deleted, within noise: not marked


def test_vs_best_leaves_out_the_best_and_a_non_finite_step():
    from stages.evaluate.paired import vs_best, within_noise

    grids = np.zeros((3, 2, 1, 1, 3))
    grids[0, :, 0, 0, 0], grids[1, :, 0, 0, 0], grids[2, 0, 0, 0, 0] = [1.0, 3.0], [1.5, 1.5], np.inf
    diffs = vs_best(grids, [2.0, 1.5, np.inf], 1)
    assert diffs[1] is None and diffs[2] is None
    assert diffs[0] == {"difference": 0.5, "standard_error": pytest.approx(1.0), "n": 2} and within_noise(diffs[0])
    assert not within_noise(None) and not within_noise({"difference": 0.0, "standard_error": None, "n": 1})
    assert not within_noise({"difference": -0.05, "standard_error": 0.001, "n": 5})  # better by far: told apart
    assert within_noise({"difference": -0.001, "standard_error": 0.001, "n": 5})


def test_a_report_that_stated_the_winners_own_numbers_is_summarised_again(run_and_store, tiny_edit_model, tmp_path):
    """A report from before the best was confirmed on other samples (no `checkpoints.selection`) is not current:
    rerun, it is summarised again from the loss array (no checkpoint evaluated again) with the line saying why."""
    import io
    from contextlib import redirect_stdout

    root, out = run_and_store, tmp_path / "report"
    ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    metrics = json.loads((out / "metrics.json").read_text())
    del metrics["checkpoints"]["selection"]
    metrics.pop("checksum", None)  # edited by hand: unsealed, as a report of an earlier release
    (out / "metrics.json").write_text(json.dumps(metrics))
    said = io.StringIO()
    with redirect_stdout(said):
        res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out, skip_if_done=True)
    assert not res.up_to_date and res.evaluated == 0
    assert ("best checkpoint picked and stated on the same val samples -> picked on half the val samples, stated on "
            "the other (halves by sha256 of their keys)") in said.getvalue()
    assert json.loads((out / "metrics.json").read_text())["checkpoints"]["selection"]["how"] == "split"


def test_a_report_told_apart_by_two_standard_errors_at_any_size_is_summarised_again(run_and_store, tiny_edit_model,
                                                                                    tmp_path):
    """A report whose verdict and '≈ best' were told by 2 s.e. over any number of samples (no
    `checkpoints.selection.verdict`) is not current: rerun, it is summarised again, no checkpoint evaluated."""
    import io
    from contextlib import redirect_stdout

    root, out = run_and_store, tmp_path / "report"
    ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    metrics = json.loads((out / "metrics.json").read_text())
    del metrics["checkpoints"]["selection"]["verdict"]
    metrics.pop("checksum", None)  # edited by hand: unsealed, as a report of an earlier release
    (out / "metrics.json").write_text(json.dumps(metrics))
    said = io.StringIO()
    with redirect_stdout(said):
        res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out, skip_if_done=True)
    assert not res.up_to_date and res.evaluated == 0
    assert "differences told apart beyond two standard errors at any number of samples -> beyond Student's t" in (
        said.getvalue()), said.getvalue()
    assert json.loads((out / "metrics.json").read_text())["checkpoints"]["selection"]["verdict"].startswith(
        "beyond Student's t")
    again = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out, skip_if_done=True)
    assert again.up_to_date
