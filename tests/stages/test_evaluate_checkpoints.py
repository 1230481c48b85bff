"""`evaluate --all-checkpoints`: a run whose three checkpoints are built so the best one is known (a zero LoRA is
the base exactly; a large random one is worse), the zarr group read back by xarray with its named dimensions,
an append killed before its commit, a checkpoint already evaluated skipped, a changed setting -> a new array."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr
from typer.testing import CliRunner

from models.loading import load_component
from models.lora import add_lora, save_lora
from pipeline.cli import app
from schemas.config import EvaluateConfig, LoraConfig
from stages.evaluate import checkpoints as ev, loss_pass
from stages.evaluate.loss_groups import group_hash
from stages.evaluate.report_current import named_steps
from store.loss_array import GROUP
from lora_writer import add_checkpoint_lora, write_checkpoint as _write_lora, write_in_processes
from train_store import make_train_store, mixed_specs
import warm_start

CFG = dict(noise_seeds=[0, 1], timesteps=[0.3, 0.7], batch_size=4, num_samples=0, device="cpu")


@pytest.fixture(scope="module")
def run_and_store(tiny_edit_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    make_train_store(root / "store", tiny_edit_model, mixed_specs(1, 5, masks=True))
    transformer = load_component(tiny_edit_model, "transformer")
    add_checkpoint_lora(transformer)
    # step 10: far from the base (worse); steps 20 and 30: zero LoRAs, the base itself -> a tie, the earlier wins
    for step, scale in ((10, 20.0), (20, 0.0), (30, 0.0)):
        _write_lora(transformer, root / "run" / "checkpoints" / f"step-{step}", scale)
    return root


def _ckpts(root):
    return [(s, root / "run" / "checkpoints" / f"step-{s}" / "lora") for s in (10, 20, 30)]


def _own_run(root, tmp_path):
    """A copy of the shared run's checkpoints in a run folder of the test's own: (step, resolved LoRA folder)."""
    import shutil

    copies = []
    for step, path in _ckpts(root):
        shutil.copytree(path.parent, tmp_path / "run" / "checkpoints" / f"step-{step}")
        copies.append((step, (tmp_path / "run" / "checkpoints" / f"step-{step}" / "lora").resolve()))
    return copies


def test_best_checkpoint_known_by_construction_and_zarr_reads_in_xarray(run_and_store, tiny_edit_model, tmp_path):
    root = run_and_store
    out = tmp_path / "report"
    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    assert res.evaluated == 3
    c = res.metrics["checkpoints"]
    assert c["steps"] == [10, 20, 30]
    assert res.best["step"] == 20 and res.best["path"].endswith("step-20/lora")
    assert res.metrics["checkpoints"]["last"]["step"] == 30
    base = c["base"]["overall"]
    assert c["per_step"][1]["overall"] == pytest.approx(base, rel=1e-6)  # a zero LoRA is the base
    assert c["per_step"][0]["overall"] > base
    assert "step 20" in str(res) and res.best["path"] in str(res)
    assert res.to_json()["best_checkpoint"] == res.best["path"]

    ds = xr.open_zarr(out / GROUP).sortby("step")  # appended newest first
    assert ds.loss.dims == ("step", "sample", "seed", "sigma", "region")
    assert ds.base_loss.dims == ("sample", "seed", "sigma", "region")
    assert list(ds.step.values) == [10, 20, 30] and list(ds.region.values) == ["all", "inside", "outside"]
    assert list(ds.sigma.values) == [0.3, 0.7] and list(ds.seed.values) == [0, 1] and ds.sizes["sample"] == 5
    assert set(ds.bucket.values) and str(ds.checkpoint.values[1]).endswith("step-20/lora")
    per_step = ds.loss.sel(region="all").mean(["sample", "seed", "sigma"]).values
    np.testing.assert_allclose(per_step, [p["overall"] for p in c["per_step"]], rtol=1e-6)
    # inside / outside exist for the masked samples only
    assert np.isnan(ds.loss.sel(region="inside").values).any() and np.isfinite(ds.loss.sel(region="inside").values).any()

    # metrics.json keeps the single-LoRA `loss` section (base vs the best checkpoint)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["loss"]["overall"]["base"] == pytest.approx(base, rel=1e-6)
    assert metrics["checkpoints"]["best"]["step"] == 20

    # evaluated again: nothing recomputed; with skip_if_done: up to date
    again = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    assert again.evaluated == 0 and again.best["step"] == 20
    assert ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out, skip_if_done=True).up_to_date

    # a changed evaluation setting starts a new array; the old one is kept beside it
    changed = ev.run(EvaluateConfig(**{**CFG, "timesteps": [0.5]}), root / "store", tiny_edit_model, _ckpts(root), out)
    assert changed.evaluated == 3
    assert xr.open_zarr(out / GROUP).sizes["sigma"] == 1
    kept = [p for p in out.iterdir() if p.name.startswith("losses.") and p.name != GROUP]
    assert len(kept) == 1 and xr.open_zarr(kept[0]).sizes["sigma"] == 2


KILLED_APPEND = """
import os, signal, sys
from pathlib import Path
import zarr
from schemas.config import EvaluateConfig
from stages.evaluate import checkpoints as ev

real, commits = zarr.consolidate_metadata, []

def dies_at_fifth_commit(path, *a, **k):  # group created, computed_on noted, base, step 30 (newest first); SIGKILL:
    commits.append(path)                 # step 20 written
    if len(commits) == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, *a, **k)

zarr.consolidate_metadata = dies_at_fifth_commit
store, model, out, cfg = sys.argv[1], sys.argv[2], sys.argv[3], eval(sys.argv[4])
root = Path(store).parent
ckpts = [(s, root / "run" / "checkpoints" / f"step-{s}" / "lora") for s in (10, 20, 30)]
ev.run(EvaluateConfig(**cfg), store, model, ckpts, out)
"""


def test_killed_append_leaves_a_readable_array_and_the_rerun_completes_it(run_and_store, tiny_edit_model, tmp_path):
    """A process SIGKILLed between writing a checkpoint's chunk and its commit (a deterministic point, not a
    timed kill): the array reads without the partial step, and the rerun evaluates only what is missing."""
    import os
    import signal
    import sys
    from pathlib import Path

    root, out = run_and_store, tmp_path / "report"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HF_HUB_OFFLINE": "1"}
    proc = warm_start.run([sys.executable, "-c", KILLED_APPEND, str(root / "store"), tiny_edit_model, str(out),
                           repr(CFG)], env=env, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (out / GROUP / "loss" / "c" / "1").exists()  # step 20's chunk is on disk, beyond the committed shape
    ds = xr.open_zarr(out / GROUP)
    assert list(ds.step.values) == [30]  # the partial step 20 is not part of the array
    assert np.isfinite(ds.loss.sel(region="all").values).all()
    first = ds.loss.values.copy()

    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    assert res.evaluated == 2 and res.best["step"] == 20
    ds = xr.open_zarr(out / GROUP)
    assert list(ds.step.values) == [30, 20, 10]  # the rerun appends the missing ones, newest first
    np.testing.assert_array_equal(ds.loss.values[:1], first)


KILLED_MID_FILE = """
import contextlib, os, signal, sys
from pathlib import Path
import zarr
import zarr.storage._local as local
from schemas.config import EvaluateConfig
from stages.evaluate import checkpoints as ev

store, model, out, cfg = sys.argv[1], sys.argv[2], sys.argv[3], eval(sys.argv[4])
real_write = local._atomic_write

@contextlib.contextmanager
def dies_inside_the_second_steps_loss_chunk(path, *a, **k):  # step 30 committed; step 20's chunk (row 1)
    with real_write(path, *a, **k) as f:
        yield f
        if "/losses.zarr/loss/c/1/" in str(path):
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # its temp file written, not yet renamed

local._atomic_write = dies_inside_the_second_steps_loss_chunk
root = Path(store).parent
ckpts = [(s, root / "run" / "checkpoints" / f"step-{s}" / "lora") for s in (10, 20, 30)]
ev.run(EvaluateConfig(**cfg), store, model, ckpts, out)
"""


def test_a_write_killed_inside_a_zarr_file_leaves_no_temp_file_after_the_rerun(run_and_store, tiny_edit_model,
                                                                               tmp_path):
    """zarr writes each file of losses.zarr as NAME.<uuid>.partial and renames it; a SIGKILL between (here: inside
    step 20's first file, a deterministic point) left that file in the group after every later run."""
    import os
    import signal
    import sys

    root, out = run_and_store, tmp_path / "report"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HF_HUB_OFFLINE": "1"}
    proc = warm_start.run([sys.executable, "-c", KILLED_MID_FILE, str(root / "store"), tiny_edit_model, str(out),
                           repr(CFG)], env=env, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert list((out / GROUP).rglob("*.partial"))  # the killed write's temp file
    assert list(xr.open_zarr(out / GROUP).step.values) == [30]

    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    assert res.evaluated == 2
    assert list(xr.open_zarr(out / GROUP).step.values) == [30, 20, 10]
    assert list((out / GROUP).rglob("*.partial")) == []


def test_cli_all_checkpoints_json_names_the_best_path(run_and_store, tiny_edit_model, tmp_path):
    root = run_and_store
    args = ["run", "evaluate", "--all-checkpoints", "--run", str(root / "run"), "--store", str(root / "store"),
            "--model", tiny_edit_model, "--out", str(tmp_path / "report"), "--json", "--num-samples", "0",
            *[x for k, v in {"evaluate.noise_seeds": "[0]", "evaluate.timesteps": "[0.5]"}.items()
              for x in ("--set", f"{k}={v}")]]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    record = json.loads(res.stdout.strip().splitlines()[-1])
    assert record["best_step"] == 20 and record["best_checkpoint"].endswith("step-20/lora")
    assert record["checkpoints"] == [10, 20, 30] and not record["up_to_date"]
    # the model's variant, as every stage that runs one records it (README; it was left out here, not in `run all`)
    assert record["variant"] == "edit"
    # the same command again: up to date, as in `run all` (before: every sample image generated again)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    again = json.loads(res.stdout.strip().splitlines()[-1])
    assert again["up_to_date"] and again["best_step"] == 20 and again["checkpoints"] == [10, 20, 30]


# After `load`: decoded images, and the curves' drawn size (a polyline with a zero box is not visible).
CURVE_PROBE = """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  const lines = [...document.querySelectorAll('svg.curve polyline')];
  const drawn = lines.filter(l => { const b = l.getBBox(); return b.width > 50; }).length;
  const best = document.querySelectorAll('svg.curve circle.best').length;
  document.body.setAttribute('data-probe', ok + '/' + imgs.length + ' lines ' + drawn + '/' + lines.length + ' best ' + best);
});
</script>"""


def test_report_renders_in_chromium_with_curves_and_base_best_last(run_and_store, tiny_edit_model, tmp_path):
    import re
    import subprocess
    import sys
    from pathlib import Path

    from PIL import Image

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline"))
    from test_report_html import CHROMIUM_FLAGS, _chromium

    root = run_and_store
    cfg = EvaluateConfig(**{**CFG, "num_samples": 2, "num_inference_steps": 2})
    res = ev.run(cfg, root / "store", tiny_edit_model, _ckpts(root), tmp_path / "report")
    text = res.report.read_text()
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    assert "<script" not in text
    for label in ("base", "best (step 20)", "last (step 30)"):
        assert label in text
    # curves: overall, per bucket, inside / outside; one line per bucket
    n_buckets = len(res.metrics["checkpoints"]["base"]["per_bucket"])
    assert text.count("<svg class='curve'") == 3
    n_lines = 1 + n_buckets + 2
    srcs = re.findall(r"src='([^']*)'", text)

    probe = tmp_path / "probe.html"
    probe.write_text(text.replace("</body>", CURVE_PROBE + "</body>"))
    run = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chrome'}", "--virtual-time-budget=10000"]
    dom = subprocess.run([*run, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120).stdout
    assert f'data-probe="{len(srcs)}/{len(srcs)} lines {n_lines}/{n_lines} best 1"' in dom, dom[-1500:]
    assert "Best checkpoint" in dom and res.best["path"] in dom

    shot = tmp_path / "shot.png"
    subprocess.run([*run, f"--screenshot={shot}", "--window-size=1300,1100", res.report.as_uri()],
                   capture_output=True, timeout=120)
    img = Image.open(shot).convert("RGB")
    colors = img.getcolors(1 << 20)
    assert colors is not None and len(colors) > 50  # not a blank page: text, curves, images
    import os

    if os.environ.get("H5_KEEP_SCREENSHOT"):  # to look at it: H5_KEEP_SCREENSHOT=/some/file.png
        img.save(os.environ["H5_KEEP_SCREENSHOT"])


def test_compare_two_runs_page_and_csv_and_refuses_other_held_out_sets(run_and_store, tiny_edit_model, tmp_path):
    import csv

    root = run_and_store
    ckpts = _ckpts(root)
    ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ckpts, tmp_path / "a" / "report")
    # run b: the same held-out set, other checkpoints (its best is its step 5, the zero LoRA)
    ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, [(5, ckpts[1][1]), (15, ckpts[0][1])],
           tmp_path / "b" / "report")
    out = tmp_path / "cmp"
    res = CliRunner().invoke(app, ["compare", str(tmp_path / "a" / "report"), str(tmp_path / "b" / "report"),
                                   "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    record = json.loads(res.stdout)
    assert [r["best_step"] for r in record["runs"]] == [20, 5]
    rows = list(csv.DictReader((out / "curves.csv").open()))
    assert [(r["run"], r["step"]) for r in rows if r["best"]] == [(record["runs"][0]["label"], "20"),
                                                                  (record["runs"][1]["label"], "5")]
    assert {r["step"] for r in rows} == {"base", "5", "10", "15", "20", "30"}
    base_rows = [float(r["loss"]) for r in rows if r["step"] == "base"]
    assert base_rows[0] == base_rows[1]  # one held-out set, one base
    page = (out / "index.html").read_text()
    assert page.count("<svg class='curve'") >= 2 and "<script" not in page

    # another σ grid: refused, the difference named
    ev.run(EvaluateConfig(**{**CFG, "timesteps": [0.5]}), root / "store", tiny_edit_model, ckpts[:1],
           tmp_path / "c" / "report")
    res = CliRunner().invoke(app, ["compare", str(tmp_path / "a" / "report"), str(tmp_path / "c" / "report"),
                                   "--out", str(tmp_path / "cmp2")])
    assert res.exit_code == 1 and "held-out sets differ in σ grid" in res.output, res.output
    # the same held-out set at another LoRA scale: not one scale either, the setting named
    ev.run(EvaluateConfig(**{**CFG, "lora_scale": 0.5}), root / "store", tiny_edit_model, ckpts[:1],
           tmp_path / "e" / "report")
    res = CliRunner().invoke(app, ["compare", str(tmp_path / "a" / "report"), str(tmp_path / "e" / "report"),
                                   "--out", str(tmp_path / "cmp4")])
    assert res.exit_code == 1 and "differ in evaluate settings (lora_scale: 1.0 vs 0.5)" in res.output, res.output
    # another store (other val samples): refused
    make_train_store(tmp_path / "store2", tiny_edit_model, mixed_specs(1, 3, masks=True), tag="other")
    ev.run(EvaluateConfig(**CFG), tmp_path / "store2", tiny_edit_model, ckpts[:1], tmp_path / "d" / "evaluate-report")  # a kept run
    res = CliRunner().invoke(app, ["compare", str(tmp_path / "a" / "report"), str(tmp_path / "d"),
                                   "--out", str(tmp_path / "cmp3")])
    assert res.exit_code == 1 and "held-out sets differ in store tables" in res.output, res.output
    assert not (tmp_path / "cmp2").exists() and not (tmp_path / "cmp3").exists()


def test_a_checkpoint_with_non_finite_losses_on_some_samples_is_never_the_best(run_and_store, tiny_edit_model,
                                                                               tmp_path):
    """A diverging checkpoint overflows on some val samples only (inf on the largest images, as in bf16) and is
    low on the rest: its held-out loss is not finite, so it is never the best. Before, the per-step mean left its
    non-finite rows out (meant for the NaN inside / outside of unmasked samples), so its mean over the easy
    samples alone was the lowest and it was named the best checkpoint."""
    import csv
    import math

    import zarr

    root, out = run_and_store, tmp_path / "report"
    ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    group = zarr.open_group(out / GROUP, mode="r+", use_consolidated=True)
    steps = [int(s) for s in group["step"][:]]
    assert sorted(steps) == [10, 20, 30]
    diverged = np.asarray(group["base_loss"][:]) * 0.5  # half the base's loss on every row ...
    diverged[0] = np.inf  # ... but inf on every row of one sample
    group["loss"][steps.index(10)] = diverged.astype("float32")

    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    assert res.evaluated == 0  # the recorded numbers, summarised again
    c = res.metrics["checkpoints"]
    assert not math.isfinite(c["per_step"][0]["overall"])  # not the mean of the other samples
    assert res.best["step"] == 20 and res.best["path"].endswith("step-20/lora")
    bucket = next(b for b in c["per_step"][0]["per_bucket"] if not math.isfinite(c["per_step"][0]["per_bucket"][b]))
    assert bucket  # the bucket of the overflowing sample shows it too
    # inside / outside stay finite numbers for the finite checkpoints (NaN there only marks "no two-region mask")
    assert math.isfinite(c["per_step"][1]["inside"]) and math.isfinite(c["base"]["outside"])
    assert json.loads((out / "metrics.json").read_text())["checkpoints"]["best"]["step"] == 20

    # `pipeline compare` reads the same array the same way
    import shutil

    shutil.copytree(out, tmp_path / "copy")
    cmp = CliRunner().invoke(app, ["compare", str(out), str(tmp_path / "copy"), "--out", str(tmp_path / "cmp"),
                                   "--json"])
    assert cmp.exit_code == 0, cmp.output
    assert [r["best_step"] for r in json.loads(cmp.stdout)["runs"]] == [20, 20]
    rows = {r["step"]: r for r in csv.DictReader((tmp_path / "cmp" / "curves.csv").open()) if r["run"] == "report"}
    assert float(rows["20"]["loss"]) == pytest.approx(c["per_step"][1]["overall"], rel=1e-6)
    assert float(rows["base"]["loss_inside"]) == pytest.approx(c["base"]["inside"], rel=1e-6)


def test_a_checkpoint_lora_damaged_after_its_commit_is_refused_naming_it(run_and_store, tiny_edit_model, tmp_path):
    """A checkpoint's resume.json seals the CRC32C of its lora/ file (stages/train/state.py), as the final LoRA's
    checksums.json does; single-LoRA evaluate checks the latter. --all-checkpoints read the checkpoints without
    that check: a flipped bit in a weight (still finite) was evaluated as if trained, and when the step was
    already in the array, taken for 'another run trained into this folder' (the earlier numbers put aside)."""
    import shutil

    from schemas.errors import UserError
    from stages.train.state import file_checksums
    from store.checksum import seal

    root = tmp_path / "root"
    shutil.copytree(run_and_store / "run", root / "run")
    for step in (10, 20, 30):  # what train commits: every file's size and CRC32C, sealed
        folder = root / "run" / "checkpoints" / f"step-{step}"
        (folder / "resume.json").write_bytes(seal({"files": file_checksums(folder)}))
    ckpts, out = _ckpts(root), tmp_path / "report"
    assert ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, ckpts, out).evaluated == 3

    weights = ckpts[1][1] / "pytorch_lora_weights.safetensors"
    data = bytearray(weights.read_bytes())
    header = int.from_bytes(data[:8], "little")
    data[8 + header] ^= 1  # the lowest mantissa bit of the first weight: still a finite number
    weights.write_bytes(bytes(data))
    for kwargs in ({}, {"skip_if_done": True}):
        with pytest.raises(UserError, match=r"step-20.*lora.*damaged") as e:
            ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, ckpts, out, **kwargs)
        assert "\n" not in str(e.value) and "checkpoint step 20" in str(e.value)
    assert not [p for p in out.iterdir() if p.name.startswith("losses.") and p.name != GROUP]  # nothing put aside
    assert sorted(xr.open_zarr(out / GROUP).step.values) == [10, 20, 30]


def test_a_moved_run_folder_keeps_its_losses_and_names_the_checkpoints_where_they_are(run_and_store,
                                                                                     tiny_edit_model, tmp_path):
    """The run folder moved (renamed, or mounted elsewhere) after its checkpoints were evaluated: the same bytes
    are not evaluated again, and the best is chosen among the run's checkpoints with their present paths. Before,
    'still on disk' was judged by the recorded paths: every checkpoint looked deleted and evaluate stopped with
    'no checkpoint ... has a finite held-out loss' (and an up-to-date report named paths that no longer exist)."""
    import shutil

    root, out = tmp_path / "root", tmp_path / "report"
    shutil.copytree(run_and_store / "run", root / "run")
    first = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), out)
    assert first.best["step"] == 20
    (root / "run").rename(root / "moved")
    moved = [(s, root / "moved" / "checkpoints" / f"step-{s}" / "lora") for s in (10, 20, 30)]

    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, moved, out, skip_if_done=True)
    assert not res.up_to_date and res.evaluated == 0  # a new report (other paths), the same bytes' losses
    assert res.best["step"] == 20 and res.best["path"] == str(moved[1][1].resolve())
    assert res.metrics["checkpoints"]["last"]["path"] == str(moved[2][1].resolve())
    assert res.metrics["checkpoints"]["paths"] == [str(p.resolve()) for _, p in moved]
    assert res.best["loss"] == first.best["loss"]
    again = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, moved, out, skip_if_done=True)
    assert again.up_to_date and again.best["path"] == str(moved[1][1].resolve())

    # a checkpoint pruned since (train.keep_last) stays in the curves but is never the best
    shutil.rmtree(root / "moved" / "checkpoints" / "step-20")
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, [moved[0], moved[2]], out)
    assert res.metrics["checkpoints"]["steps"] == [10, 20, 30] and res.best["step"] == 30
    # and the report's table says its path names no file any more (it listed it as any other; compare's CSV
    # said on_disk no): a user picking a checkpoint from the table copied a path that is not there
    assert res.metrics["checkpoints"]["on_disk"] == [True, False, True]
    page = (out / "index.html").read_text()
    rows = re.findall(r"<td>step (\d+)[^<]*</td><td>([^<]*)</td>", page)
    assert [(int(step), "(removed" in path) for step, path in rows] == [(10, False), (20, True), (30, False)]


def test_lora_dropout_of_the_training_config_is_off_while_evaluating(tiny_edit_model, tmp_path):
    """A LoRA trained with train.lora.dropout > 0 keeps lora_dropout in its saved adapter config. peft builds the
    attached layers (their Dropout included) in training mode although the loaded model is in eval mode, so
    evaluate drew dropout masks from the global RNG: two checkpoints with the same bytes got different held-out
    losses (the best pick a coin toss) and the single-LoRA report another number again. With the adapter in eval
    mode the numbers are the LoRA's own, the same every time."""
    from stages.evaluate import stage as single

    make_train_store(tmp_path / "store", tiny_edit_model, mixed_specs(1, 4))
    transformer = load_component(tiny_edit_model, "transformer")
    add_lora(transformer, LoraConfig(rank=4, alpha=4.0, dropout=0.5))
    for step in (10, 20):  # the same weights twice
        _write_lora(transformer, tmp_path / "run" / "checkpoints" / f"step-{step}", 0.5)
    ckpts = [(s, tmp_path / "run" / "checkpoints" / f"step-{s}" / "lora") for s in (10, 20)]
    cfg = EvaluateConfig(**CFG)
    res = ev.run(cfg, tmp_path / "store", tiny_edit_model, ckpts, tmp_path / "report")
    ds = xr.open_zarr(tmp_path / "report" / GROUP)
    np.testing.assert_array_equal(ds.loss.values[0], ds.loss.values[1])
    assert not np.array_equal(ds.loss.values[0], ds.base_loss.values)  # the LoRA does change the numbers
    one = single.run(cfg, tmp_path / "store", tiny_edit_model, ckpts[0][1], tmp_path / "single")
    assert one.metrics["loss"]["overall"]["lora"] == pytest.approx(res.best["loss"], rel=1e-6)


def test_a_lora_trained_on_another_base_model_is_named_in_a_warning(tiny_edit_model, tmp_path, capsys):
    """A LoRA records its base model's fingerprint (train writes it into every checkpoint's and the final LoRA's
    metadata). Stores are shared between models with the same VAE and text encoder (Edit -> Edit-2509), so
    evaluate runs without error on another base, and its numbers say nothing about the LoRA: predict and merge
    warn (or refuse with --strict-base); evaluate said nothing."""
    from models.loading import model_fingerprint
    from stages.evaluate import stage as single

    make_train_store(tmp_path / "store", tiny_edit_model, mixed_specs(1, 2))
    transformer = load_component(tiny_edit_model, "transformer")
    # peft draws lora_A from the global RNG: seeded, so the "far" LoRA is the same in any test order (it was
    # not, and after tests/stages/test_train_ddp.py it lowered this tiny random model's loss: a random direction
    # can; with this seed it raises it)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        add_lora(transformer, LoraConfig(rank=4, alpha=4.0))
    for step in (10, 20):
        folder = tmp_path / "run" / "checkpoints" / f"step-{step}"
        save_lora(transformer, folder / "lora", base_fingerprint="0" * 64)  # trained on some other model
        (folder / "resume.json").write_text("{}")
    ckpts = [(s, tmp_path / "run" / "checkpoints" / f"step-{s}" / "lora") for s in (10, 20)]
    cfg = EvaluateConfig(**{**CFG, "noise_seeds": [0], "timesteps": [0.5]})
    capsys.readouterr()
    single.run(cfg, tmp_path / "store", tiny_edit_model, ckpts[0][1], tmp_path / "single")
    out = capsys.readouterr().out
    assert out.count("warning: LoRA") == 1 and "was trained on a base model with fingerprint 0000" in out
    ev.run(cfg, tmp_path / "store", tiny_edit_model, ckpts, tmp_path / "report")
    out = capsys.readouterr().out
    assert out.count("warning: LoRA") == 1 and "(checkpoints 10, 20)" in out, out
    # the LoRA of this very model: no warning
    save_lora(transformer, tmp_path / "own", base_fingerprint=model_fingerprint(tiny_edit_model))
    single.run(cfg, tmp_path / "store", tiny_edit_model, tmp_path / "own", tmp_path / "own-report")
    assert "warning" not in capsys.readouterr().out


def test_another_runs_checkpoints_in_the_same_report_folder_start_a_new_array(run_and_store, tiny_edit_model,
                                                                              tmp_path):
    """REPORT evaluated run A (steps 10-30); then run B, whose checkpoints are at other steps (40, 50), into the
    same --out. Before, nothing told them apart (only a step recorded with other bytes did): B's report held A's
    steps in its curves, table and step list. Now A's numbers are kept aside and B's array holds B alone; A's
    checkpoints are still on disk, which is what tells another run from checkpoints pruned or a run moved."""
    import shutil

    out = tmp_path / "report"
    ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(run_and_store), out)
    b = tmp_path / "b" / "checkpoints"
    for new, old in ((40, 30), (50, 10)):
        shutil.copytree(run_and_store / "run" / "checkpoints" / f"step-{old}", b / f"step-{new}")
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model,
                 [(s, b / f"step-{s}" / "lora") for s in (40, 50)], out)
    assert res.metrics["checkpoints"]["steps"] == [40, 50] and res.evaluated == 2
    assert res.best["step"] == 40 and res.best["path"].startswith(str(b.resolve()))
    assert sorted(xr.open_zarr(out / GROUP).step.values) == [40, 50]
    kept = [p for p in out.iterdir() if p.name.startswith("losses.") and p.name != GROUP]
    assert len(kept) == 1 and sorted(xr.open_zarr(kept[0]).step.values) == [10, 20, 30]


def test_the_line_promises_no_take_back_of_a_kept_group_of_other_val_samples(run_and_store, tiny_edit_model,
                                                                           tmp_path, capsys):
    """Run A, run B, then A again, A's kept group holding other val samples (one skipped as damaged then, say):
    evaluate takes it not back and evaluates A's checkpoints (`LossStore`, `_plan`: kept groups of these samples
    only), and the line saying why now says so; it judged kept groups without their samples and promised "the
    losses of 3 checkpoints ..., taken back, kept: no checkpoint evaluated again"."""
    import shutil

    import zarr

    out, a = tmp_path / "report", _ckpts(run_and_store)
    b_run = tmp_path / "b" / "checkpoints"
    shutil.copytree(run_and_store / "run" / "checkpoints" / "step-10", b_run / "step-40")
    cfg, store = EvaluateConfig(**CFG), run_and_store / "store"
    ev.run(cfg, store, tiny_edit_model, a, out)
    ev.run(cfg, store, tiny_edit_model, [(40, b_run / "step-40" / "lora")], out)
    (kept,) = [p for p in out.glob("losses.*.zarr") if p.name != GROUP]
    g = zarr.open_group(kept, mode="r+", use_consolidated=True)
    keys = [str(k) for k in g["sample"][:]]
    g["sample"][:] = np.array(keys[:-1] + ["another-sample"], dtype=object)
    capsys.readouterr()
    res = ev.run(cfg, store, tiny_edit_model, a, out, skip_if_done=True)
    said = capsys.readouterr().out
    assert res.evaluated == 3
    assert "): evaluating every checkpoint again (the losses in " in said and "taken back" not in said, said


def test_going_back_to_an_earlier_run_takes_its_kept_losses_back(run_and_store, tiny_edit_model, tmp_path,
                                                                 monkeypatch, capsys):
    """Run A, run B, then A again into the same --out, one setting throughout: B kept A's array aside (its
    checkpoints are another run's), and the third run kept B's aside and evaluated A's three checkpoints and the
    base from scratch, A's numbers lying beside it (a take-back was only looked for when the settings differed).
    Now it takes A's array back: nothing evaluated, the numbers a fresh evaluation gives."""
    import shutil

    from test_evaluate_checkpoints_base_cache import _counting

    out, a = tmp_path / "report", _ckpts(run_and_store)
    b_run = tmp_path / "b" / "checkpoints"
    for new, old in ((40, 30), (50, 10)):
        shutil.copytree(run_and_store / "run" / "checkpoints" / f"step-{old}", b_run / f"step-{new}")
    b = [(s, b_run / f"step-{s}" / "lora") for s in (40, 50)]
    cfg, store = EvaluateConfig(**CFG), run_and_store / "store"
    first = ev.run(cfg, store, tiny_edit_model, a, out)
    assert ev.run(cfg, store, tiny_edit_model, b, out).evaluated == 2
    passes = _counting(monkeypatch)
    capsys.readouterr()
    again = ev.run(cfg, store, tiny_edit_model, a, out, skip_if_done=True)
    assert again.evaluated == 0 and passes == [], passes
    said = capsys.readouterr().out
    assert "this run's are taken back from" in said, said
    # the line saying why names what it costs, as `_plan` then does: nothing
    assert re.search(r"writing the report again \(the losses of 3 checkpoints in \S+losses\.[0-9a-f]{12}(\.\d+)?\.zarr, "
                     r"taken back, kept: no checkpoint evaluated again\)", said), said
    assert again.metrics["checkpoints"]["steps"] == [10, 20, 30]
    fresh = ev.run(cfg, store, tiny_edit_model, a, tmp_path / "fresh")
    kept, computed = (xr.open_zarr(o / GROUP).sortby("step") for o in (out, tmp_path / "fresh"))
    for name in ("loss", "base_loss"):
        np.testing.assert_array_equal(kept[name].values, computed[name].values)
    assert again.metrics["checkpoints"]["per_step"] == fresh.metrics["checkpoints"]["per_step"] == \
        first.metrics["checkpoints"]["per_step"]
    # B's array kept in turn: B again takes it back too, and no copies pile up
    assert ev.run(cfg, store, tiny_edit_model, b, out, skip_if_done=True).evaluated == 0
    assert len(list(out.glob("losses.*.zarr"))) == 1


def test_a_run_trained_afresh_into_the_same_folder_does_not_inherit_the_old_runs_steps(run_and_store,
                                                                                     tiny_edit_model, tmp_path):
    """RUN (steps 10-30, learning rate A) evaluated into REPORT; then `pipeline run train --new-run` (or RUN deleted)
    trains RUN afresh with learning rate B, and its one checkpoint is step 5. Before, the old steps, no longer on
    disk, passed for checkpoints the new run had pruned: 'evaluated 1 of 4 checkpoints (3 already in ...)' and
    the new run's curve went on with the old run's numbers. Now what trained each step is recorded beside it (its
    resume.json's inputs): the old run's steps go aside. The run's own pruned steps stay (same training)."""
    import shutil

    def checkpoint(run: Path, step: int, old: int, lr_fingerprint: str) -> tuple[int, Path]:
        folder = run / "checkpoints" / f"step-{step}"
        shutil.copytree(run_and_store / "run" / "checkpoints" / f"step-{old}", folder)
        (folder / "resume.json").write_text(json.dumps({"config_fingerprint": lr_fingerprint, "step": step}))
        return step, folder / "lora"

    run, out = tmp_path / "run", tmp_path / "report"
    first = [checkpoint(run, s, s, "lr-a") for s in (10, 20, 30)]
    ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, first, out)
    shutil.rmtree(first[0][1].parent)  # pruned by the run itself: its point stays
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, first[1:], out)
    assert res.metrics["checkpoints"]["steps"] == [10, 20, 30] and res.evaluated == 0

    shutil.move(run, tmp_path / "run.previous")  # --new-run keeps the old run beside RUN
    again = [checkpoint(run, 5, 10, "lr-b")]
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, again, out)
    assert res.metrics["checkpoints"]["steps"] == [5] and res.evaluated == 1
    assert list(xr.open_zarr(out / GROUP).step.values) == [5]
    kept = [p for p in out.iterdir() if p.name.startswith("losses.") and p.name != GROUP]
    assert len(kept) == 1 and sorted(xr.open_zarr(kept[0]).step.values) == [10, 20, 30]


def test_a_run_resumed_under_a_later_release_keeps_its_pruned_steps(run_and_store, tiny_edit_model, tmp_path):
    """A run whose first checkpoints were written before resume.json recorded the tables' contents and the init
    LoRA's bytes, resumed under this release (`stages/train/start.resume_point` takes it for the same run: the
    same table versions, `known_init_lora`): its later records carry both. Once the training pruned the old
    checkpoints, their steps passed for another training's (its id hashed other fields) and every earlier point
    went aside: 'the run's checkpoints are not the ones evaluated before'."""
    import shutil

    def checkpoint(step: int, old: int, record: dict) -> tuple[int, Path]:
        folder = run / "checkpoints" / f"step-{step}"
        shutil.copytree(run_and_store / "run" / "checkpoints" / f"step-{old}", folder)
        (folder / "resume.json").write_text(json.dumps({"step": step, **record}))
        return step, folder / "lora"

    run, out = tmp_path / "run", tmp_path / "report"
    before = {"config_fingerprint": "cfg", "model_fingerprint": "m", "training_revision": 3,
              "tables": {"text": "text-v1", "vae": "vae-v1"}}  # an earlier release's record: neither field
    after = {**before, "init_lora_sha256": "a1b2", "table_contents": {"text": "c-text", "vae": "c-vae"}}
    first = [checkpoint(10, 10, before), checkpoint(20, 20, before)]
    ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, first, out)
    resumed = checkpoint(30, 30, after)
    ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, [first[1], resumed], out)
    for _, lora in first:
        shutil.rmtree(lora.parent)  # train.keep_checkpoints pruned them
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, [resumed], out)
    assert res.metrics["checkpoints"]["steps"] == [10, 20, 30] and res.evaluated == 0
    assert not [p for p in out.iterdir() if p.name.startswith("losses.") and p.name != GROUP]

    # a training of other tables (by content) is still another training: its steps go aside
    other = checkpoint(40, 30, {**after, "tables": {"text": "text-v2", "vae": "vae-v1"},
                                "table_contents": {"text": "c-text-2", "vae": "c-vae"}})
    shutil.rmtree(resumed[1].parent)
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, [other], out)
    assert res.metrics["checkpoints"]["steps"] == [40]


def test_a_record_without_a_backend_is_one_training_only_with_its_own_runs(run_and_store, tiny_edit_model, tmp_path):
    """Checkpoints recorded before resume.json held `attention_backend` (steps 10, 20) were taken for a training of
    any backend: RUN trained afresh with `packed` under the same config fingerprint (it hashes no backend name)
    passed for the old run, and its curve went on with the old run's steps. Now such a record's backend is the one
    its run's resume took it for (`UNRECORDED_BACKEND`, carried in the later records), else unknown: the old steps
    go aside. Its own run resumed keeps them (pruned, they stay on the curve)."""
    import shutil

    from schemas.record_formats import UNRECORDED_BACKEND

    def checkpoint(step: int, old: int, record: dict) -> tuple[int, Path]:
        folder = run / "checkpoints" / f"step-{step}"
        shutil.copytree(run_and_store / "run" / "checkpoints" / f"step-{old}", folder)
        (folder / "resume.json").write_text(json.dumps({"step": step, **record}))
        return step, folder / "lora"

    run = tmp_path / "run"
    before = {"config_fingerprint": "cfg", "model_fingerprint": "m", "training_revision": 3,
              "tables": {"text": "text-v1", "vae": "vae-v1"}}  # an earlier release's record: no backend
    first = [checkpoint(10, 10, before), checkpoint(20, 20, before)]
    ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, first, tmp_path / "report")
    shutil.copytree(tmp_path / "report", tmp_path / "report-2")

    resumed = checkpoint(30, 30, {**before, "attention_backend": "native", "extra": {UNRECORDED_BACKEND: "native"}})
    for _, lora in first:
        shutil.rmtree(lora.parent)  # train.keep_checkpoints pruned them
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, [resumed], tmp_path / "report")
    assert res.metrics["checkpoints"]["steps"] == [10, 20, 30] and res.evaluated == 1

    out = tmp_path / "report-2"  # the steps 10, 20 evaluated; then RUN trained afresh with packed instead
    shutil.move(run, tmp_path / "run.previous")  # --new-run keeps the old run beside RUN
    afresh = [checkpoint(5, 10, {**before, "attention_backend": "packed"})]
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, afresh, out)
    assert res.metrics["checkpoints"]["steps"] == [5] and res.evaluated == 1
    kept = [p for p in out.iterdir() if p.name.startswith("losses.") and p.name != GROUP]
    assert len(kept) == 1 and sorted(xr.open_zarr(kept[0]).step.values) == [10, 20]


def test_a_second_evaluate_into_the_same_report_folder_stops_at_once(tmp_path: Path) -> None:
    """Two evaluates writing one report folder would interleave its loss array and pages: the second stops before
    reading anything, naming the folder and the first's pid (held here as the first would hold it)."""
    import os

    from schemas.errors import UserError
    from stages.evaluate import checkpoints as ev, stage as single
    from stages.evaluate.report_folder import REPORT_LOCK
    from store.format import flock

    out = tmp_path / "report"
    out.mkdir()
    with flock(out / REPORT_LOCK):
        for run, what in ((single.run, tmp_path / "lora"), (ev.run, [(10, tmp_path / "lora")])):
            with pytest.raises(UserError) as e:
                run(None, tmp_path / "store", "model", what, out)  # nothing is read before the lock
            assert str(out) in str(e.value) and f"pid {os.getpid()}" in str(e.value) and "\n" not in str(e.value)
    assert [p.name for p in out.iterdir()] == [REPORT_LOCK]


def test_a_run_folder_that_does_not_exist_is_named(tmp_path: Path) -> None:
    """A misspelled --run used to say only "the run folder holds no checkpoints/step-N"."""
    from pipeline.orchestrate import kept_checkpoints
    from schemas.errors import UserError

    with pytest.raises(UserError, match=f"run folder {tmp_path / 'rnu'} does not exist"):
        kept_checkpoints(tmp_path / "rnu")


def respell_report(out, settings: dict) -> str:
    """OUT's loss array and metrics.json as an earlier release recorded them: these settings, and their hash as the
    fingerprint (returned)."""
    import json

    import zarr

    group = zarr.open_group(out / GROUP, mode="r+", use_consolidated=True)
    old = group_hash(settings)
    group.attrs.update({"fingerprint": old, "settings": settings})
    zarr.consolidate_metadata(out / GROUP)
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["checkpoints"]["fingerprint"] = old
    metrics.pop("checksum", None)  # edited by hand: unsealed, as a report of an earlier release
    (out / "metrics.json").write_text(json.dumps(metrics))
    return old


def test_a_moved_store_keeps_the_losses_and_the_report(run_and_store, tiny_edit_model, tmp_path):
    """The store moved (or a store URL's cache is in another folder): its tables' identities (number and manifest
    hash) are the same, so are the numbers. Before, the store's path was part of the loss array's fingerprint:
    a new array began and every checkpoint was evaluated again. An array recorded under that earlier spelling is
    this setting's too: its losses are kept and it is recorded under the present one at its next write."""
    import shutil

    import zarr

    store, out = tmp_path / "store", tmp_path / "report"
    shutil.copytree(run_and_store / "store", store)
    first = ev.run(EvaluateConfig(**CFG), store, tiny_edit_model, _ckpts(run_and_store), out)
    assert first.evaluated == 3
    moved = tmp_path / "moved-store"
    store.rename(moved)
    res = ev.run(EvaluateConfig(**CFG), moved, tiny_edit_model, _ckpts(run_and_store), out, skip_if_done=True)
    assert res.up_to_date

    # the array and report as the earlier release wrote them: the store's path in the settings and fingerprint
    group = zarr.open_group(out / GROUP, mode="r", use_consolidated=True)
    old = respell_report(out, {**group.attrs["settings"], "store": str(store.resolve())})
    res = ev.run(EvaluateConfig(**CFG), moved, tiny_edit_model, _ckpts(run_and_store), out, skip_if_done=True)
    assert res.up_to_date
    res = ev.run(EvaluateConfig(**CFG), moved, tiny_edit_model, _ckpts(run_and_store), out)  # a forced rerun
    assert res.evaluated == 0 and res.best["loss"] == first.best["loss"]
    assert zarr.open_group(out / GROUP, mode="r", use_consolidated=True).attrs["fingerprint"] != old
    assert not list(out.glob("losses.*.zarr"))  # nothing set aside


def test_a_moved_store_keeps_a_single_lora_report_current(run_and_store, tiny_edit_model, tmp_path):
    """The same for one LoRA's report: its recorded inputs held the store's path (a report recorded so stays
    current too: the path is left out of the comparison)."""
    import json
    import shutil

    from stages.evaluate import stage

    store, out = tmp_path / "store", tmp_path / "report"
    shutil.copytree(run_and_store / "store", store)
    lora = _ckpts(run_and_store)[0][1]
    stage.run(EvaluateConfig(**CFG), store, tiny_edit_model, lora, out)
    moved = tmp_path / "moved-store"
    store.rename(moved)
    assert stage.run(EvaluateConfig(**CFG), moved, tiny_edit_model, lora, out, skip_if_done=True).up_to_date
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["run"]["inputs"]["store"] = str(store.resolve())  # as the earlier release recorded them
    metrics.pop("checksum", None)  # edited by hand: unsealed, as a report of an earlier release
    (out / "metrics.json").write_text(json.dumps(metrics))
    assert stage.run(EvaluateConfig(**CFG), moved, tiny_edit_model, lora, out, skip_if_done=True).up_to_date


def test_a_report_killed_before_its_rewrite_is_not_taken_for_retrained_checkpoints(run_and_store, tiny_edit_model,
                                                                                     tmp_path, monkeypatch):
    """The run was trained again into the same folder (same steps and paths, other weights). Evaluate appends the
    new weights' losses, then is killed before it rewrites the report (out of memory generating the pictures, a
    SIGTERM). Before, the up-to-date check took the LoRA hashes from the loss array (the new ones) and the old
    report's steps and paths matched: `run all` returned the previous weights' report as current. Now the report
    records the hashes its numbers are of."""
    import shutil

    from stages.evaluate import checkpoint_report

    root, out = tmp_path / "root", tmp_path / "report"
    shutil.copytree(run_and_store / "run", root / "run")
    first = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), out)
    assert first.best["step"] == 20
    step10 = root / "run" / "checkpoints" / "step-10" / "lora"
    shutil.rmtree(step10)
    shutil.copytree(root / "run" / "checkpoints" / "step-30" / "lora", step10)  # retrained: the base now

    def killed(*a, **k):
        raise KeyboardInterrupt("killed before the report was written (test)")

    monkeypatch.setattr(checkpoint_report, "write_checkpoint_report", killed)
    with pytest.raises(KeyboardInterrupt):
        ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), out)
    monkeypatch.undo()
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), out, skip_if_done=True)
    assert not res.up_to_date and res.evaluated == 0  # the new weights' losses were kept
    assert res.best["step"] == 10  # its numbers are the retrained weights' (the base: a tie, the earlier wins)


def test_a_step_retrained_to_the_same_weights_is_not_evaluated_again(run_and_store, tiny_edit_model, tmp_path):
    """A deterministic retrain writes every step's LoRA again, with the same weights, from another process. Before,
    safetensors wrote the metadata in the order of a HashMap seeded per process (and peft's target_modules set in
    the str hash order), so the same weights made other bytes, another sha256: 'the run's checkpoints are not the
    ones evaluated before', every step evaluated again. Now the writer's bytes are canonical
    (`models.canonical_safetensors`): nothing is recomputed. Other weights are still another checkpoint."""
    run, out = tmp_path / "run" / "checkpoints", tmp_path / "report"
    ckpts = [(s, run / f"step-{s}" / "lora") for s in (10, 20)]
    write_in_processes(tiny_edit_model, {1: [(run / "step-10", 20.0), (run / "step-20", 0.0)]})
    assert ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, ckpts, out).evaluated == 2
    write_in_processes(tiny_edit_model, {2: [(run / "step-10", 20.0), (run / "step-20", 0.0)]})  # the retrain
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, ckpts, out, skip_if_done=True)
    assert res.up_to_date and res.evaluated == 0
    assert not [p for p in out.iterdir() if p.name.startswith("losses.") and p.name != GROUP]  # nothing set aside

    # trained otherwise: other weights (written here: other bytes need no process of their own, and a cold one
    # costs seconds of imports)
    transformer = load_component(tiny_edit_model, "transformer")
    add_checkpoint_lora(transformer)
    _write_lora(transformer, run / "step-20", 5.0)
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, ckpts, out, skip_if_done=True)
    assert not res.up_to_date and res.evaluated == 2  # the array went aside: step 20 is not the weights recorded


def test_a_step_retrained_with_other_weights_says_every_checkpoint_is_evaluated_again(run_and_store, tiny_edit_model,
                                                                                      tmp_path, capsys):
    """Step 20 trained again into the run with other weights: its old losses are not reused, the array goes aside
    and every checkpoint is evaluated again, and the line saying why says so (it said "evaluating 1 of 3
    checkpoints (the losses of 2 checkpoints ... kept)", then evaluated 3)."""
    import shutil

    root, out = tmp_path / "root", tmp_path / "report"
    shutil.copytree(run_and_store / "run", root / "run")
    first = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), out)
    transformer = load_component(tiny_edit_model, "transformer")
    add_checkpoint_lora(transformer)
    _write_lora(transformer, root / "run" / "checkpoints" / "step-20", 5.0)  # was the base (a zero LoRA)
    capsys.readouterr()
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(root), out, skip_if_done=True)
    said = capsys.readouterr().out
    assert res.evaluated == 3 and res.best["step"] == 30
    assert res.metrics["checkpoints"]["per_step"][1]["overall"] > first.metrics["checkpoints"]["per_step"][1]["overall"]
    assert "): evaluating every checkpoint again (checkpoint step 20 holds other weights than the losses recorded" \
        in said and "1 of 3" not in said, said


def test_a_run_trained_on_past_its_pruned_checkpoints_counts_their_kept_losses(run_and_store, tiny_edit_model,
                                                                               tmp_path, capsys):
    """A run resumed to more steps (`run all --set train.max_steps=...`): keep_checkpoints pruned the steps the
    report holds, one new step is on disk. Their losses stay in the report, and the line saying why it is redone
    counts them as the end line does; it said "evaluating 1 of 1 checkpoints (the losses of 0 checkpoints ...
    kept)" and then "evaluated 1 of 3 checkpoints (2 already in ...)"."""
    import shutil

    root, out = tmp_path / "root", tmp_path / "report"
    shutil.copytree(run_and_store / "run", root / "run")
    ckpts = _ckpts(root)
    ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, ckpts[:2], out)
    for _, path in ckpts[:2]:
        shutil.rmtree(path.parent)  # pruned by the resumed training
    capsys.readouterr()
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, ckpts[2:], out, skip_if_done=True)
    said = capsys.readouterr().out
    assert res.evaluated == 1 and res.metrics["checkpoints"]["steps"] == [10, 20, 30]
    assert "): evaluating 1 of 3 checkpoints (the losses of 2 checkpoints in " in said, said
    # the step trained since is named as such, not as its sha256 and path against None
    assert "(checkpoints not in the report: step 30; " in said and "None" not in said, said
    # the same run with more checkpoints: said so (it was called "not this run's")
    assert "is this run's from before it trained on (" in said and "not this run's" not in said, said


def test_a_bar_with_nothing_to_do_is_not_drawn(run_and_store, tiny_edit_model, tmp_path, capsys):
    """Evaluated again with every checkpoint in the array: no checkpoints bar (it read "checkpoints: 0ckpt
    [00:00, ?ckpt/s]": no total, no percentage); one with work shows its count, rate and ETA."""
    out = tmp_path / "report"
    capsys.readouterr()
    ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(run_and_store), out)
    bars = [b for b in re.split(r"[\r\n]", capsys.readouterr().err) if b.startswith("checkpoints:")]
    assert bars and re.match(r"checkpoints: 100%.* 3/3 \[\d\d:\d\d<00:00, .*ckpt/s\]", bars[-1]), bars
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, _ckpts(run_and_store), out)
    drawn = capsys.readouterr().err
    assert res.evaluated == 0 and not re.search(r"[: ]0ckpt \[", drawn), drawn
    assert not [b for b in re.split(r"[\r\n]", drawn) if b.startswith("checkpoints:")], drawn


def test_compare_names_the_best_checkpoint_still_on_disk_as_the_report_does(run_and_store, tiny_edit_model, tmp_path):
    """keep_checkpoints pruned the lowest-loss step after evaluate recorded it: the report names the best of the
    checkpoints still there, and so does `pipeline compare` (it named the pruned step, a path that is gone); the
    pruned step keeps its point on the curve, marked in the CSV."""
    import csv
    import shutil

    root = run_and_store
    copies = _own_run(root, tmp_path)  # pruning one of them leaves the shared run as it is
    out = tmp_path / "report"
    assert ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, copies, out).best["step"] == 20
    shutil.copytree(out, tmp_path / "other")
    shutil.rmtree(copies[1][1].parent)  # step 20 pruned
    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, [copies[0], copies[2]], out)
    report_best = res.best["step"]
    assert report_best != 20
    cmp = CliRunner().invoke(app, ["compare", str(out), str(tmp_path / "other"), "--out", str(tmp_path / "cmp"),
                                   "--json"])
    assert cmp.exit_code == 0, cmp.output
    assert [r["best_step"] for r in json.loads(cmp.stdout)["runs"]] == [report_best, report_best]
    rows = {r["step"]: r for r in csv.DictReader((tmp_path / "cmp" / "curves.csv").open()) if r["run"] == "report"}
    assert rows["20"]["on_disk"] == "no" and rows["20"]["best"] == "" and rows["10"]["on_disk"] == "yes"


def test_json_last_step_is_the_last_checkpoint_still_on_disk(run_and_store, tiny_edit_model, tmp_path):
    """The last checkpoint (step 30) removed after it was evaluated: the report's `last` (its pictures, its row)
    is step 20, and --json's `last_step` named step 30, the array's last step, a checkpoint no longer there."""
    import shutil

    root = run_and_store
    copies = []
    for step, path in _ckpts(root):
        shutil.copytree(path.parent, tmp_path / "run" / "checkpoints" / f"step-{step}")
        copies.append((step, tmp_path / "run" / "checkpoints" / f"step-{step}" / "lora"))
    out = tmp_path / "report"
    ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, copies, out)
    shutil.rmtree(copies[2][1].parent)
    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, copies[:2], out)
    assert res.metrics["checkpoints"]["last"]["step"] == 20
    assert res.to_json()["last_step"] == 20


def test_a_removed_best_checkpoint_makes_the_report_out_of_date(run_and_store, tiny_edit_model, tmp_path):
    """The best checkpoint deleted after its report was written: the rerun (skip_if_done, as `pipeline run
    evaluate` and `run all` run it) names the best checkpoint still on disk. It said the report was up to date and
    named the deleted step's path as the best, a LoRA no longer there; no checkpoint is evaluated again."""
    import shutil

    root = run_and_store
    copies = _own_run(root, tmp_path)
    out = tmp_path / "report"
    assert ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, copies, out).best["step"] == 20
    shutil.rmtree(copies[1][1].parent)  # the best, step 20, deleted
    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, [copies[0], copies[2]], out,
                 skip_if_done=True)
    assert not res.up_to_date and res.evaluated == 0
    assert res.best["step"] == 30 and Path(res.best["path"]).is_dir()
    assert json.loads((out / "metrics.json").read_text())["checkpoints"]["best"]["step"] == 30
    # the report rewritten: up to date again
    assert ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, [copies[0], copies[2]], out,
                  skip_if_done=True).up_to_date


def test_why_a_report_is_redone_names_its_inputs_in_one_order(run_and_store, tiny_edit_model, tmp_path):
    """The line saying why a report is summarised again lists the stale inputs in one order: the best's selection
    rule before the named checkpoints still on disk (as before `_selection_inputs`, which moved it after them)."""
    import io
    import shutil
    from contextlib import redirect_stdout

    root = run_and_store
    copies = _own_run(root, tmp_path)
    out = tmp_path / "report"
    assert ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, copies, out).best["step"] == 20
    metrics = json.loads((out / "metrics.json").read_text())
    del metrics["checkpoints"]["selection"]
    metrics.pop("checksum", None)  # edited by hand: unsealed, as a report of an earlier release
    (out / "metrics.json").write_text(json.dumps(metrics))
    shutil.rmtree(copies[1][1].parent)  # the best, step 20, deleted
    said = io.StringIO()
    with redirect_stdout(said):
        res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, [copies[0], copies[2]], out,
                     skip_if_done=True)
    assert not res.up_to_date and res.evaluated == 0
    text = said.getvalue()
    rule, named = text.find("best checkpoint picked and stated"), text.find("checkpoints the report names")
    assert 0 <= rule < named, text


def test_json_names_every_path_absolute_with_a_relative_out(run_and_store, tiny_edit_model, tmp_path, monkeypatch):
    """--out given relative: `report` and `losses` (on an up-to-date rerun too, where `losses` came from the
    recorded metrics.json) were relative while `best_checkpoint` was absolute; every path is absolute now."""
    root = run_and_store
    monkeypatch.chdir(tmp_path)
    args = ["run", "evaluate", "--all-checkpoints", "--run", str(root / "run"), "--store", str(root / "store"),
            "--model", tiny_edit_model, "--out", "report", "--json", "--num-samples", "0",
            "--set", "evaluate.noise_seeds=[0]", "--set", "evaluate.timesteps=[0.5]"]
    for up_to_date in (False, True):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        record = json.loads(res.stdout.strip().splitlines()[-1])
        assert record["up_to_date"] == up_to_date
        paths = {k: record[k] for k in ("report", "losses", "best_checkpoint")}
        assert all(Path(p).is_absolute() and Path(p).exists() for p in paths.values()), paths
        assert paths["report"] == str(tmp_path.resolve() / "report" / "index.html")


def test_going_back_to_earlier_settings_takes_their_kept_losses_back(run_and_store, tiny_edit_model, tmp_path, capsys):
    """Settings A, then B, then A again: B's run kept A's losses aside as `losses.<A>.zarr`, and the third run
    evaluated every checkpoint again under A (the encoders make an earlier version current). Now it takes A's
    array back (B's kept aside in turn): nothing evaluated, the same numbers. The steps are judged as ever (LoRA
    bytes, trainings), so a checkpoint rewritten meanwhile is still evaluated again."""
    out, ckpts = tmp_path / "report", _ckpts(run_and_store)
    a, b = EvaluateConfig(**CFG), EvaluateConfig(**{**CFG, "timesteps": [0.5]})
    assert ev.run(a, run_and_store / "store", tiny_edit_model, ckpts, out).evaluated == 3
    before = xr.open_zarr(out / GROUP).loss.sortby("step").values
    assert ev.run(b, run_and_store / "store", tiny_edit_model, ckpts, out).evaluated == 3
    capsys.readouterr()
    again = ev.run(a, run_and_store / "store", tiny_edit_model, ckpts, out, skip_if_done=True)
    assert again.evaluated == 0
    np.testing.assert_array_equal(xr.open_zarr(out / GROUP).loss.sortby("step").values, before)
    said = capsys.readouterr()
    assert "taken back" in said.out + said.err and "checkpoint is evaluated again" not in said.out + said.err
    # the line saying why names what it costs: nothing (it said "evaluating every checkpoint again")
    assert re.search(r"evaluate\.timesteps: \[0\.5\] -> \[0\.3, 0\.7\]\): writing the report again \(the losses of 3 "
                     r"checkpoints in \S+losses\.[0-9a-f]{12}\.zarr, taken back, kept: no checkpoint evaluated again\)",
                     said.out), said.out
    # B's losses kept in turn: going to B again takes them back too
    assert ev.run(b, run_and_store / "store", tiny_edit_model, ckpts, out, skip_if_done=True).evaluated == 0
    assert len(list(out.glob("losses.*.zarr"))) == 1  # A's, kept aside once more: no copies pile up


def test_a_full_disk_while_the_loss_array_is_written_names_the_report_folder(run_and_store, tiny_edit_model,
                                                                              tmp_path, monkeypatch):
    """ENOSPC inside a zarr write of losses.zarr (its group created on a full disk, or a step's chunk) reached the
    CLI's last-resort handler, which named no file: `disk full while writing output in . (68250.3 MB free)` - the
    cwd and its free space, not the report folder that filled up. Now the line names the loss array and the
    report folder, and the rerun after freeing space completes what was committed."""
    import contextlib
    import errno

    import zarr.storage._local as local

    from store.io_errors import DiskFullError

    root, out = run_and_store, tmp_path / "report"
    real_write = local._atomic_write

    @contextlib.contextmanager
    def full_at_the_second_steps_chunk(path, *a, **k):  # step 30 committed; step 20's chunk fails
        if "/losses.zarr/loss/c/1/" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        with real_write(path, *a, **k) as f:
            yield f

    monkeypatch.setattr(local, "_atomic_write", full_at_the_second_steps_chunk)
    with pytest.raises(DiskFullError) as e:
        ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    assert "loss" in str(e.value) and f" in {out} (" in str(e.value), str(e.value)
    monkeypatch.undo()
    assert list(xr.open_zarr(out / GROUP).step.values) == [30]  # what was committed is kept
    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, _ckpts(root), out)
    assert res.evaluated == 2 and sorted(xr.open_zarr(out / GROUP).step.values) == [10, 20, 30]


@pytest.mark.parametrize("damaged", ["[1, 2]", '{"checkpoints": 5}', '{"checkpoints": {"steps": 3}}'])
def test_a_metrics_json_that_is_not_a_report_record_is_written_over(run_and_store, tiny_edit_model, tmp_path,
                                                                      damaged):
    """metrics.json damaged into other valid JSON (a list, a number where a section was): the up-to-date check
    stopped with an AttributeError traceback (`'list' object has no attribute 'get'`); JSON that did not parse was
    already taken for no report. Now both are: the report is made again."""
    ckpts, out = _ckpts(run_and_store)[:1], tmp_path / "report"
    assert ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, ckpts, out).evaluated == 1
    (out / "metrics.json").write_text(damaged)
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, ckpts, out, skip_if_done=True)
    assert not res.up_to_date and json.loads((out / "metrics.json").read_text())["checkpoints"]["steps"] == [10]


def test_a_lost_chunk_file_of_the_loss_array_is_refused_not_read_as_a_non_finite_step(run_and_store, tiny_edit_model,
                                                                                       tmp_path, capsys, monkeypatch):
    """A chunk file of losses.zarr deleted or lost on disk (a damaged disk, a partial copy of the report) read back
    as NaN, the fill value, as a checkpoint whose every loss is non-finite: `compare` drew step 20 as NaN and named
    step 30 the best, and evaluate summarised the array so ("evaluated 0 of 4", best step 30). Every chunk is now
    a file (the all-NaN checkpoint's too): `compare` refuses in one line naming the file, evaluate sets the array
    aside naming it and evaluates again. A genuinely all-NaN checkpoint still reads as NaN, and an array written
    by the previous release (no file for that step) still reads, saying what it cannot check."""
    import csv
    import math
    import shutil

    import zarr

    root, out = run_and_store, tmp_path / "report"
    shutil.copytree(root / "run", tmp_path / "run")
    transformer = load_component(tiny_edit_model, "transformer")
    add_checkpoint_lora(transformer)
    _write_lora(transformer, tmp_path / "run" / "checkpoints" / "step-40", 5.0)
    real = loss_pass._grid

    def diverged_at_40(*a, **k):  # every loss of step 40 NaN (a LoRA diverged in bf16; a NaN LoRA file is refused)
        grid = real(*a, **k)
        return np.full_like(grid, np.nan) if "(step 40)" in a[7] else grid

    monkeypatch.setattr(loss_pass, "_grid", diverged_at_40)
    ckpts = [(s, tmp_path / "run" / "checkpoints" / f"step-{s}" / "lora") for s in (10, 20, 30, 40)]
    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ckpts, out)
    assert res.evaluated == 4 and res.best["step"] == 20
    assert math.isnan(res.metrics["checkpoints"]["per_step"][3]["overall"])
    rows = {int(s): i for i, s in enumerate(zarr.open_group(out / GROUP, mode="r")["step"][:])}

    def chunk(folder: Path, step: int) -> Path:
        return folder / GROUP / "loss" / "c" / str(rows[step]) / "0" / "0" / "0" / "0"

    assert chunk(out, 40).is_file()  # the all-NaN row is a file too
    for copy in ("copy", "copy2"):
        shutil.copytree(out, tmp_path / copy)
    chunk(out, 20).unlink()

    cmp = CliRunner().invoke(app, ["compare", str(out), str(tmp_path / "copy"), "--out", str(tmp_path / "cmp")])
    assert cmp.exit_code == 1 and len(cmp.output.strip().splitlines()) == 1, cmp.output
    assert f"{chunk(out, 20)} is missing" in cmp.output and "rerun `pipeline run evaluate`" in cmp.output
    capsys.readouterr()
    again = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ckpts, out, skip_if_done=True)
    said = capsys.readouterr()
    line = next(x for x in (said.out + said.err).splitlines() if "is missing" in x)
    assert f"{chunk(out, 20)} is missing" in line and "every checkpoint is evaluated again" in line
    assert again.evaluated == 4 and again.best["step"] == 20 and not again.up_to_date

    # the intact copies: the all-NaN checkpoint reads as NaN, never the best
    cmp = CliRunner().invoke(app, ["compare", str(tmp_path / "copy"), str(tmp_path / "copy2"), "--out",
                                   str(tmp_path / "cmp2"), "--json"])
    assert cmp.exit_code == 0, cmp.output
    assert [r["best_step"] for r in json.loads(cmp.stdout)["runs"]] == [20, 20]
    steps = {r["step"]: r for r in csv.DictReader((tmp_path / "cmp2" / "curves.csv").open()) if r["run"] == "copy"}
    assert math.isnan(float(steps["40"]["loss"])) and math.isfinite(float(steps["20"]["loss"]))

    # as the previous release wrote it (store tests: the same files): format 1, no file for the all-NaN row
    record = tmp_path / "copy2" / GROUP / "zarr.json"
    meta = json.loads(record.read_text())
    meta["attributes"]["format"] = 1
    record.write_text(json.dumps(meta))
    chunk(tmp_path / "copy2", 40).unlink()
    capsys.readouterr()
    old = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ckpts, tmp_path / "copy2")
    said = capsys.readouterr()
    assert old.evaluated == 0 and old.best["step"] == 20  # kept: nothing evaluated again
    assert math.isnan(old.metrics["checkpoints"]["per_step"][3]["overall"])
    assert f"no chunk file {chunk(tmp_path / 'copy2', 40)};" in said.out + said.err
    cmp = CliRunner().invoke(app, ["compare", str(tmp_path / "copy"), str(tmp_path / "copy2"), "--out",
                                   str(tmp_path / "cmp3"), "--json"])
    assert cmp.exit_code == 0 and [r["best_step"] for r in json.loads(cmp.stdout)["runs"]] == [20, 20], cmp.output
    assert f"no chunk file {chunk(tmp_path / 'copy2', 40)};" in cmp.output


def test_a_checkpoint_removed_since_an_up_to_date_report_is_marked_removed(run_and_store, tiny_edit_model, tmp_path):
    """A checkpoint the report neither names best, next best nor last, removed after the report was written: the
    rerun (skip_if_done, as `pipeline run evaluate` and `run all` run it) said the report was up to date, its table
    listing the removed step's path as any other and metrics.json's on_disk true. The report is written again
    marking it removed; no checkpoint is evaluated again, and the next rerun finds it up to date."""
    import shutil

    root = run_and_store
    copies = _own_run(root, tmp_path)
    out = tmp_path / "report"
    first = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, copies, out)
    named = named_steps(first.metrics["checkpoints"])
    assert named == [20, 30], named  # step 10 (the worst, not the last) is named by nothing
    shutil.rmtree(copies[0][1].parent)  # step 10 removed
    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, copies[1:], out, skip_if_done=True)
    assert not res.up_to_date and res.evaluated == 0
    c = json.loads((out / "metrics.json").read_text())["checkpoints"]
    assert c["steps"] == [10, 20, 30] and c["on_disk"] == [False, True, True]
    # says why, in the user's terms (it said "pruned by the training")
    assert f"{copies[0][1]} (removed: the training keeps only its newest checkpoints (train.keep_checkpoints); " \
        in (out / "index.html").read_text()
    assert ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, copies[1:], out,
                  skip_if_done=True).up_to_date


def test_a_checkpoint_of_other_module_sizes_is_refused_naming_its_step_and_what_to_do(run_and_store,
                                                                                     tiny_edit_model, tmp_path):
    """A checkpoint whose tensors fit no module of this model (a LoRA of another base model copied into the run;
    unsealed, so it passes the check and fails to load): one line naming its step, file, the sizes and how to
    evaluate the others; the newer checkpoints evaluated before it stay, and the rerun without it evaluates none.
    Before: the loader's line alone ('shapes differ ... (different rank?)'), no step, nothing to do."""
    import shutil

    from safetensors.torch import load_file, save_file

    from schemas.errors import UserError

    ckpts = _own_run(run_and_store, tmp_path)
    weights = ckpts[0][1] / "pytorch_lora_weights.safetensors"  # step 10, evaluated last (newest first)
    tensors = load_file(weights)
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key] = tensors[key][:, :-1].contiguous()  # one input feature fewer: another model's module
    save_file(tensors, weights)
    out = tmp_path / "report"
    with pytest.raises(UserError) as err:
        ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, ckpts, out)
    line = str(err.value)
    assert "\n" not in line and line.startswith("checkpoint step 10: LoRA at ") and str(ckpts[0][1]) in line
    assert "saved [4, " in line and f"or move {ckpts[0][1].parent} out of the run's checkpoints/" in line
    shutil.move(ckpts[0][1].parent, tmp_path / "aside")
    res = ev.run(EvaluateConfig(**CFG), run_and_store / "store", tiny_edit_model, ckpts[1:], out)
    assert res.evaluated == 0 and res.best["step"] == 20
