"""`evaluate --all-checkpoints` over two gloo processes (`pipeline launch`): each rank computes half of the val
samples' held-out losses and the sums are the one-process numbers; rank 0 alone writes the array and the report
and prints the summary. A rank failing in its own loss pass, or loading a checkpoint, stops both ranks with its
line (no rank waits in a collective), and what was committed before is kept: the rerun evaluates only
the rest."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from schemas.config import EvaluateConfig
from stages.evaluate import checkpoints as ev
from store.loss_array import GROUP
import warm_start
from test_evaluate_checkpoints import CFG, _ckpts, run_and_store  # noqa: F401 (the module fixture)

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """The launcher's environment, taken when it starts: the session's TMPDIR and caches (tests/conftest.py) and
    so the warm parent of the other tests (one taken at import had its own: ~9 s of CPU importing torch again)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests' / 'stages'}",
           "OMP_NUM_THREADS": "1", "PIPELINE_PROGRESS_SECONDS": "0"}  # every bar's start a line (pipeline/bars.py)
    env.pop("WORLD_SIZE", None)
    return env


# rank 1 fails at step 20: in its own loss pass (as an out-of-memory would: `fails_alone`), or loading the
# checkpoint (a step all ranks take `together`), inside the CLI's own run
FAILING_RANK = """
import os, sys
FAIL_IN = sys.argv.pop(1)  # an argument, not a variable: the ranks' environment is every rank test's (one warm parent)
import models.lora
from stages.evaluate import loss_pass
from schemas.errors import UserError
real_grid, real_load = loss_pass.loss_grid, models.lora.load_lora
def loss_grid(*a, **k):
    if os.environ["RANK"] == "1" and FAIL_IN == "loss" and "step 20" in a[-1]:
        raise UserError("rank 1 cannot compute step 20 (injected)")
    return real_grid(*a, **k)
def load_lora(transformer, path, *a, **k):
    if os.environ["RANK"] == "1" and FAIL_IN == "load" and "step-20" in str(path):
        raise UserError("rank 1 cannot load step 20 (injected)")
    return real_load(transformer, path, *a, **k)
loss_pass.loss_grid, models.lora.load_lora = loss_grid, load_lora
from pipeline.cli import app
sys.argv = ["pipeline", *sys.argv[1:]]
app()
"""


# rank 1's device named otherwise (another GPU model on another node): the array records each rank's
OTHER_DEVICE_RANK = """
import os, sys
from stages.evaluate import base_images
real = base_images.machine
def machine(cfg):
    m = real(cfg)
    return {**m, "device": [m["device"][0], ["probe device of rank 1"]]} if os.environ["RANK"] == "1" else m
base_images.machine = machine
from pipeline.cli import app
sys.argv = ["pipeline", *sys.argv[1:]]
app()
"""


def _args(root, model, out) -> list[str]:
    return ["run", "evaluate", "--all-checkpoints", "--set", f"paths.run={root / 'run'}", "--store",
            str(root / "store"), "--model", model, "--out", str(out), "--num-samples", "0", "--device", "cpu",
            "--set", "evaluate.noise_seeds=[0, 1]", "--set", "evaluate.timesteps=[0.3, 0.7]",
            "--set", "evaluate.batch_size=4"]


def test_two_ranks_give_the_one_process_numbers(run_and_store, tiny_edit_model, tmp_path):
    root = run_and_store
    one = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), tmp_path / "one")
    # the launcher started warm (tests/warm_start.py: torch imported already); its two ranks are torchrun's own
    proc = warm_start.run([sys.executable, "-m", "pipeline.cli", "launch", "--standalone", "--nproc-per-node", "2",
                           *_args(root, tiny_edit_model, tmp_path / "two")], env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("best checkpoint step 20") == 1  # rank 0 reports, once
    a, b = xr.open_zarr(tmp_path / "one" / GROUP), xr.open_zarr(tmp_path / "two" / GROUP)
    b = b.sortby("step")  # appended newest first, as one process appends them: `a` is sorted the same way
    a = a.sortby("step")
    assert list(b.step.values) == [10, 20, 30] and list(b.sample.values) == list(a.sample.values)
    # other batches (each rank batches its half): float rounding only; NaN (no two-region mask) where it was
    np.testing.assert_allclose(b.loss.values, a.loss.values, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(b.base_loss.values, a.base_loss.values, rtol=1e-5, atol=1e-7)
    assert np.array_equal(np.isnan(b.loss.values), np.isnan(a.loss.values))
    assert one.best["step"] == 20
    # the attention backend: one decision of both ranks (models/attention.py `agree`), each rank's pick recorded
    attention = json.loads((tmp_path / "two" / "metrics.json").read_text())["run"]["attention"]
    assert attention["backend"] == "native" and attention["reason"].endswith("; the same on all 2 ranks"), attention
    assert [(r["rank"], r["backend"]) for r in attention["ranks"]] == [(0, "native"), (1, "native")], attention
    # one held-out loss bar per pass, rank 0's, said to be its share (each rank drew its own, with one label)
    n = len(a.sample.values)
    for what in ("base", "step 10", "step 20", "step 30"):
        drawn = re.findall(rf"held-out loss \({what}\)( \[[^]]*\])?:\s+0%", proc.stderr)  # each bar starts at 0%
        assert drawn == [f" [rank 0's share: {(n + 1) // 2} of {n} samples]"], (what, drawn, proc.stderr[-3000:])


@pytest.mark.parametrize("fail_in", ["loss", "load"])
def test_a_failing_rank_stops_both_with_its_line_and_the_rerun_resumes(fail_in, run_and_store, tiny_edit_model,
                                                                      tmp_path):
    from two_ranks import launch_two

    root, out = run_and_store, tmp_path / "report"
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK)
    # ranks 0 and 1 started warm, as the other rank tests here (tests/stages/two_ranks.py), not under torchrun
    # (its agent and two cold ranks: ~18 s of imports): no launcher ends the rank left running, it stops itself
    (rc0, out0, err0), (rc1, out1, err1) = launch_two(str(script), fail_in, *_args(root, tiny_edit_model, out),
                                                      timeout=300)
    assert rc0 != 0 and rc1 != 0, (rc0, rc1, err0[-2000:], err1[-2000:])
    # the failing rank's line, printed by a rank as it stops
    what = "compute" if fail_in == "loss" else "load"
    named = "checkpoint step 20: " if fail_in == "load" else ""  # a load's refusal names its step and what to do
    assert f"error: {named}rank 1 cannot {what} step 20 (injected)" in out0 + err0 + out1 + err1, (err0[-3000:],
                                                                                                   err1[-3000:])
    # newest first: step 30 committed before the failure at step 20, and kept
    assert list(xr.open_zarr(out / GROUP).step.values) == [30]

    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    assert res.evaluated == 2 and res.metrics["checkpoints"]["steps"] == [10, 20, 30]


def test_ranks_that_read_different_text_versions_stop_with_one_line(run_and_store, tiny_edit_model, tmp_path):
    """Rank 1 still reads `text` v1 when v2 is current (a version made current between the ranks' opens, or a
    lagging view of store.json): before, rank 0 keyed the loss array by its own versions and the ranks' halves
    of every grid came from different features; now every rank stops with one line and nothing is written."""
    import shutil

    from store import Store
    from two_ranks import launch_two

    root, store, out = run_and_store, tmp_path / "store", tmp_path / "report"
    shutil.copytree(root / "store", store)
    st = Store(store)
    shutil.copytree(st.version_dir("text", 1), st.version_dir("text", 2))
    st.set_current("text", 2)
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "evaluate", str(store), tiny_edit_model,
                                                      str(root / "run"), str(out), "1", timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 1, (rc0, rc1, err0[-2000:], err1[-2000:])
    last0, last1 = err0.strip().splitlines()[-1], err1.strip().splitlines()[-1]
    assert last0 == last1 and "the ranks do not read the same table 'text'" in last0 and "v2 on some, v1 on" in last0
    assert not (out / GROUP).exists()


def test_ranks_that_list_different_checkpoints_evaluate_the_ones_all_see(run_and_store, tiny_edit_model, tmp_path):
    """Rank 1 does not list step 10 (a training beside evaluate pruned it between the ranks' listings, or its
    node's view of the run folder differs). Every exchange pairs the checkpoints by their place in the list:
    before, the ranks all-reduced lists of different lengths (a gloo error; NCCL: a hang) or paired one rank's
    step with another's. Now the ranks take rank 0's list less what some rank does not see, with a line."""
    from two_ranks import launch_two

    root, out = run_and_store, tmp_path / "report"
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "evaluate", str(root / "store"),
                                                      tiny_edit_model, str(root / "run"), str(out), "pruned",
                                                      timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-2000:], err1[-2000:])
    assert "checkpoint step(s) 10 not seen by every rank yet" in out0 + err0, (out0, err0)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["checkpoints"]["steps"] == [20, 30]


def test_ranks_given_different_settings_stop_with_one_line(run_and_store, tiny_edit_model, tmp_path):
    """Rank 1 is given another σ grid (its node's copy of the config differs; as many σ, so the grids' shapes
    agree). Before, each rank computed its half of every grid at its own σ and rank 0 recorded the sum under its
    own settings: exit 0, numbers of two settings mixed. Now every rank stops at the start (exit 2) with one line
    naming rank 1 and the key (pipeline/node_settings.py), and nothing is written."""
    from two_ranks import launch_two

    root, out = run_and_store, tmp_path / "report"
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_stale_view.py", "evaluate", str(root / "store"),
                                                      tiny_edit_model, str(root / "run"), str(out), "settings",
                                                      timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 2, (rc0, rc1, err0[-2000:], err1[-2000:])
    last0, last1 = err0.strip().splitlines()[-1], err1.strip().splitlines()[-1]
    assert last0 == last1, (last0, last1)
    assert "rank 1's evaluate.timesteps is [0.1, 0.3, 0.5, 0.7, 0.8], rank 0's [" in last0, last0
    assert not (out / GROUP).exists()


def test_no_recorded_checkpoint_left_stops_every_rank_with_one_line(run_and_store, tiny_edit_model, tmp_path):
    """After the loss passes the run folder, listed again, holds none of the checkpoints evaluated and none newer
    (removed meanwhile). Rank 0 alone found it and refused: rank 1 had already left evaluate and ended with
    status 0 (under `run all`: went on to what follows), so the launch read as half a success. Now both ranks
    decide it together: each ends with status 1 and the same line (a rank left waiting fails on the timeout)."""
    from two_ranks import launch_two

    root, out = run_and_store, tmp_path / "report"
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_evaluate_decisions.py", "gone", str(root / "store"),
                                                      tiny_edit_model, str(root / "run"), str(out), timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 1, (rc0, rc1, err0[-2000:], err1[-2000:])
    last0, last1 = err0.strip().splitlines()[-1], err1.strip().splitlines()[-1]
    assert last0 == last1, (last0, last1)
    assert last0.startswith("error: no checkpoint recorded in ") and "is still on disk" in last0, last0
    assert list(xr.open_zarr(out / GROUP).step.values) == [30, 20, 10]  # the losses computed are kept


def test_rank_0_failing_in_its_report_stops_every_rank_with_its_line(run_and_store, tiny_edit_model, tmp_path):
    """After the loss passes rank 0 alone makes the images and writes the report. Before, the other ranks had
    left evaluate then and ended with status 0 while rank 0 failed there (a full disk, out of memory generating):
    a node's launch read as a success. Now they wait for rank 0 (`main_alone`: through the launcher's store, not
    in a collective a long generation would time out) and end with its line and status 1."""
    from two_ranks import launch_two

    root, out = run_and_store, tmp_path / "report"
    (rc0, out0, err0), (rc1, out1, err1) = launch_two("rank_evaluate_decisions.py", "report", str(root / "store"),
                                                      tiny_edit_model, str(root / "run"), str(out), timeout=300)
    assert "Traceback" not in err0 + out0 + err1 + out1, (err0[-3000:], err1[-3000:])
    assert rc0 == rc1 == 1, (rc0, rc1, err0[-2000:], err1[-2000:])
    last0, last1 = err0.strip().splitlines()[-1], err1.strip().splitlines()[-1]
    assert last0 == last1 == f"error: cannot write the report into {out} (injected)", (last0, last1)
    assert list(xr.open_zarr(out / GROUP).step.values) == [30, 20, 10]  # the losses computed are kept


# each rank counts its base passes into RESULTS/passes-N and the target rows it predicts into RESULTS/rows-N;
# `blind`: rank 1 finds no kept base losses (its node's view of the report folder differs): rank 0's file alone
# decides. One script for the tests that count either (a launch into a fresh folder serves them all: `counted`)
COUNTING = """
import os, sys
from pathlib import Path
RESULTS, BLIND = Path(sys.argv.pop(1)), sys.argv.pop(1) == "blind"
import models.held_out as held_out
from stages.evaluate import base_losses, loss_pass
real_grid, passes = loss_pass.loss_grid, []
def loss_grid(*a, **k):
    passes.append(a[5])
    return real_grid(*a, **k)
loss_pass.loss_grid = loss_grid
real_targets, rows = held_out.target_predictions, []
held_out.target_predictions = lambda t, fb: (rows.append(len(fb.targets)), real_targets(t, fb))[1]
if BLIND and os.environ["RANK"] == "1":
    base_losses.read = lambda *a, **k: None
from pipeline.cli import app
sys.argv = ["pipeline", *sys.argv[1:]]
try:
    app()
finally:
    (RESULTS / f"passes-{os.environ['RANK']}").write_text(str(sum("(base)" in p for p in passes)))
    (RESULTS / f"rows-{os.environ['RANK']}").write_text(str(sum(rows)))
"""


def _counted_launch(results: Path, blind: bool, args: list[str]) -> tuple[list[int], list[int], str]:
    """COUNTING on two ranks: ([base passes of rank 0, 1], [target rows of rank 0, 1], rank 0's output)."""
    from two_ranks import launch_two

    results.mkdir(exist_ok=True)
    script = results / "counting.py"
    script.write_text(COUNTING)
    (rc0, out0, err0), (rc1, _, err1) = launch_two(str(script), str(results), "blind" if blind else "sees",
                                                   *args, timeout=300)
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-2000:], err1[-2000:])
    return ([int((results / f"passes-{r}").read_text()) for r in (0, 1)],
            [int((results / f"rows-{r}").read_text()) for r in (0, 1)], out0 + err0)


@pytest.fixture(scope="module")
def counted(run_and_store, tiny_edit_model, tmp_path_factory):
    """The default grid (seeds [0, 1]) on two ranks into a fresh folder, rank 1 blind to kept base losses (a fresh
    folder has none: it computes as any rank does) and the ranks alike: (folder, base passes, target rows). Read,
    never written, by the tests that need a fresh two-rank array (a launch each before)."""
    tmp = tmp_path_factory.mktemp("counted")
    passes, rows, _ = _counted_launch(tmp / "results", True, _args(run_and_store, tiny_edit_model, tmp / "fresh"))
    return tmp / "fresh", passes, rows


@pytest.fixture(scope="module")
def other_device(run_and_store, tiny_edit_model, tmp_path_factory):
    """The default grid on two ranks into a fresh folder, rank 1's device named otherwise (OTHER_DEVICE_RANK)."""
    from two_ranks import launch_two

    tmp = tmp_path_factory.mktemp("other-device")
    script = tmp / "other_device_rank.py"
    script.write_text(OTHER_DEVICE_RANK)
    (rc0, _, err0), (rc1, _, err1) = launch_two(str(script), *_args(run_and_store, tiny_edit_model, tmp / "out"),
                                                timeout=300)
    assert rc0 == rc1 == 0, (rc0, rc1, err0[-2000:], err1[-2000:])
    return tmp / "out"


def test_ranks_take_the_kept_base_losses_together(run_and_store, tiny_edit_model, counted, tmp_path):
    """A report folder with base losses of these inputs (`run all` linked the kept report's in) and no loss array:
    both ranks skip the base pass, as rank 0's file says, though rank 1 sees none; the array's base is the one a
    two-rank base pass gives (before, both ranks computed it again)."""
    from stages.evaluate import base_losses

    root, out, (fresh, fresh_passes, _) = run_and_store, tmp_path / "report", counted
    assert fresh_passes == [1, 1]  # rank 1 blind there too: a fresh folder, each rank computes its share
    out.mkdir()
    (out / base_losses.FILE).write_bytes((fresh / base_losses.FILE).read_bytes())  # recorded by rank 0

    passes, _, output0 = _counted_launch(tmp_path / "results", True, _args(root, tiny_edit_model, out))
    assert passes == [0, 0], output0[-2000:]
    assert "base held-out loss: unchanged inputs, reused" in output0
    np.testing.assert_array_equal(xr.open_zarr(out / GROUP).base_loss.values,
                                  xr.open_zarr(fresh / GROUP).base_loss.values)


def test_two_ranks_grow_a_seed_grid_computing_its_new_cells_alone(run_and_store, tiny_edit_model, counted,
                                                                  tmp_path):
    """Seeds [0] then [0, 1] over two ranks: each rank computes its share of seed 1's cells only (the plan, the
    donor's cells, broadcast from rank 0), and the array is the one two ranks give for [0, 1] afresh, bit for bit
    (`counted`: the default grid's seeds are [0, 1])."""
    root, out, (fresh, _, whole) = run_and_store, tmp_path / "report", counted

    def rows(target, seeds: str) -> list[int]:
        args = [*_args(root, tiny_edit_model, target), "--set", f"evaluate.noise_seeds={seeds}"]
        return _counted_launch(tmp_path / "results", False, args)[1]

    rows(out, "[0]")
    grown = rows(out, "[0, 1]")
    assert [2 * g for g in grown] == whole, (grown, whole)
    a, b = (xr.open_zarr(o / GROUP).sortby("step") for o in (out, fresh))
    for name in ("loss", "base_loss", "step", "seed"):
        np.testing.assert_array_equal(a[name].values, b[name].values)


def test_the_array_records_every_ranks_device(other_device):
    """Each rank computes its share of every row on its own device: `computed_on` names each (it named rank 0's
    alone, on a run of two GPU models)."""
    from stages.evaluate import base_images
    from stages.evaluate.loss_groups import COMPUTED_ON

    out = other_device
    here = base_images.machine(EvaluateConfig(**CFG))
    rank_0 = {"device": here["device"], "libraries": here["libraries"]}
    assert xr.open_zarr(out / GROUP).attrs[COMPUTED_ON] == [
        rank_0, {**rank_0, "device": ["cpu", ["probe device of rank 1"]]}]


def test_base_losses_two_ranks_computed_on_two_devices_serve_no_run_on_one_of_them(run_and_store, tiny_edit_model,
                                                                                   other_device, counted, tmp_path,
                                                                                   monkeypatch):
    """OUT/base-losses.safetensors is keyed by the machine that computed it (another GPU model rounds otherwise).
    Rank 1 on another device computed half of its rows, but the key named rank 0's machine alone: a one-process
    run on rank 0's machine took those numbers as its own. Now the key holds every rank's machine
    (`loss_groups.on_every_rank`, as the array's `computed_on`) where they differ: that run computes its base. Ranks
    alike keep the one-process key (files written before stay readable): their file serves it."""
    from stages.evaluate import base_losses
    from test_evaluate_checkpoints_base_cache import _counting

    root = run_and_store
    passes = _counting(monkeypatch)
    # the ranks alike (one machine): `counted`'s, whose counting wrappers change no number and no key
    for name, two, computed in (("other", other_device, 1), ("alike", counted[0], 0)):
        one = tmp_path / f"one-{name}"
        one.mkdir()
        (one / base_losses.FILE).write_bytes((two / base_losses.FILE).read_bytes())
        passes.clear()
        ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), one)
        assert passes.count("held-out loss (base)") == computed, (name, passes)
