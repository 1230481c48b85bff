"""`evaluate --all-checkpoints` of a run trained with train.ema_decay: each checkpoint's EMA (step-N/ema.safetensors)
is scored on the same val samples, noise and σ as its raw LoRA, reported beside it, and competes for best.

The EMA files are written as the trainer writes them (`models.ema_file`: tensors in `lora_parameters` order); the
reference evaluates each EMA the independent way, written as a LoRA through the trainer's own parameter order and
`save_lora`, then scored as a plain checkpoint."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import xarray as xr
from PIL import Image
from safetensors.torch import save_file

from models.loading import load_component
from models.lora import lora_parameters, read_lora, save_lora
from schemas.config import EvaluateConfig
from stages.evaluate import checkpoints as ev
from stages.evaluate.report import LABEL_H, TILE
from store.loss_array import GROUP
from lora_writer import add_checkpoint_lora, write_checkpoint
from train_store import make_train_store, mixed_specs

CFG = dict(noise_seeds=[0, 1], timesteps=[0.3, 0.7], batch_size=4, num_samples=0, device="cpu")
EMA_LOSSES, BEST_LORA = "ema-losses", "best-ema-lora"  # in REPORT (docs/evaluate.md)
RAW = 20.0  # a raw LoRA far from the base: worse than it (tests/stages/test_evaluate_checkpoints.py)


@pytest.fixture(scope="module")
def model_store(tiny_edit_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("ema")
    make_train_store(root / "store", tiny_edit_model, mixed_specs(1, 5, masks=True))
    transformer = load_component(tiny_edit_model, "transformer")
    add_checkpoint_lora(transformer)
    return root, transformer


def _ema_values(transformer, scale: float | None, seed: int) -> list[torch.Tensor]:
    """EMA tensors in the trainer's order: lora_B = scale x a random matrix, lora_A moved off the raw one (so a
    loader that took the raw A is seen); scale None: the raw LoRA's own values."""
    g = torch.Generator().manual_seed(seed)
    values = []
    for name, p in transformer.named_parameters():
        if not (p.requires_grad and ".lora_" in name):  # `lora_parameters`' selection, with the names
            continue
        v = p.detach().clone().float()
        if "lora_B" in name and scale is not None:
            v = torch.randn(v.shape, generator=g) * scale
        elif "lora_A" in name and scale is not None:
            v = v + 0.05 * torch.randn(v.shape, generator=g)
        values.append(v)
    assert len(values) == len(lora_parameters(transformer))
    return values


def _run(root, transformer, name: str, steps: dict[int, tuple[float, float | None, int]]):
    """RUN/checkpoints/step-N: lora/ (B = raw scale x the fixed matrix) and ema.safetensors; returns the
    checkpoints and each step's EMA values."""
    run, ema = root / name, {}
    for step, (raw, ema_scale, seed) in steps.items():
        folder = run / "checkpoints" / f"step-{step}"
        write_checkpoint(transformer, folder, raw)
        ema[step] = _ema_values(transformer, ema_scale, seed)
        save_file({str(i): v for i, v in enumerate(ema[step])}, folder / "ema.safetensors")  # as the trainer does
    return [(s, run / "checkpoints" / f"step-{s}" / "lora") for s in steps], ema


def _as_lora(transformer, values, folder):
    """The independent way: the EMA's values put into the trainer's parameters in their order (as
    `AdapterEMA.swapped_in` does), saved with `save_lora` as a checkpoint's LoRA."""
    saved = [p.detach().clone() for p in lora_parameters(transformer)]
    with torch.no_grad():
        for p, v in zip(lora_parameters(transformer), values):
            p.copy_(v)
        save_lora(transformer, folder / "lora")
        for p, v in zip(lora_parameters(transformer), saved):
            p.copy_(v)
    (folder / "resume.json").write_text("{}")
    return folder / "lora"


def test_the_ema_curve_is_each_checkpoints_ema_evaluated_as_a_lora(model_store, tiny_edit_model, tmp_path):
    root, transformer = model_store
    ckpts, ema = _run(root, transformer, "run_numbers", {10: (RAW, 1.0, 2), 20: (0.0, 3.0, 4)})
    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ckpts, tmp_path / "report")
    c = res.metrics["checkpoints"]
    assert c["ema"]["steps"] == [10, 20]

    ref_ckpts = [(s, _as_lora(transformer, ema[s], tmp_path / "ref" / "checkpoints" / f"step-{s}")) for s in ema]
    ref = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ref_ckpts, tmp_path / "ref-report")
    assert "ema" not in ref.metrics["checkpoints"]  # the reference run has no EMA files
    want = [p["overall"] for p in ref.metrics["checkpoints"]["per_step"]]
    np.testing.assert_allclose([p["overall"] for p in c["ema"]["per_step"]], want, rtol=1e-6)
    # sample for sample, and over the same base (the same val samples, noise and σ)
    got_ds = xr.open_zarr(tmp_path / "report" / EMA_LOSSES / GROUP).sortby("step")
    ref_ds = xr.open_zarr(tmp_path / "ref-report" / GROUP).sortby("step")
    np.testing.assert_allclose(got_ds.loss.values, ref_ds.loss.values, rtol=1e-6)
    np.testing.assert_array_equal(got_ds.base_loss.values, xr.open_zarr(tmp_path / "report" / GROUP).base_loss.values)
    # the raw curve is the raw LoRAs' still, and differs from the EMA's
    assert c["per_step"][1]["overall"] == pytest.approx(c["base"]["overall"], rel=1e-6)  # raw step 20: zero B
    assert all(abs(a - b) > 1e-6 for a, b in zip(want, [p["overall"] for p in c["per_step"]]))

    # the best is the lowest of all four, named with its weights
    points = [(p["overall"], s, "lora") for s, p in zip(c["steps"], c["per_step"])] + \
        [(w, s, "ema") for s, w in zip(c["ema"]["steps"], want)]
    loss, step, weights = min(points, key=lambda t: (t[0], t[1], t[2] == "ema"))
    assert (res.best["step"], res.best["weights"]) == (step, weights)
    assert res.best["loss"] == pytest.approx(loss, rel=1e-6)
    # a rerun: nothing evaluated, current
    again = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ckpts, tmp_path / "report", skip_if_done=True)
    assert again.up_to_date


def test_the_best_is_the_ema_when_its_loss_is_lower_and_its_lora_is_written(model_store, tiny_edit_model, tmp_path,
                                                                            capsys):
    root, transformer = model_store
    # raw LoRAs both far (worse than the base); step 10's EMA a zero delta (the base exactly: lower), step 20's the
    # raw LoRA's own values (as bad as it)
    ckpts, ema = _run(root, transformer, "run_ema_best", {10: (RAW, 0.0, 2), 20: (RAW, None, 4)})
    out = tmp_path / "report"
    pictured = EvaluateConfig(**{**CFG, "num_samples": 1, "num_inference_steps": 2})
    res = ev.run(pictured, root / "store", tiny_edit_model, ckpts, out)
    c = res.metrics["checkpoints"]
    assert c["ema"]["per_step"][0]["overall"] == pytest.approx(c["base"]["overall"], rel=1e-6)
    assert c["ema"]["per_step"][1]["overall"] == pytest.approx(c["per_step"][1]["overall"], rel=1e-6)
    assert (res.best["step"], res.best["weights"]) == (10, "ema")
    assert res.best["loss"] == pytest.approx(c["base"]["overall"], rel=1e-6)
    # the pick feeds a loadable LoRA holding step 10's EMA: the path the report, --json and run all name
    best = out / BEST_LORA
    assert res.best["path"] == str(best.resolve()) and res.to_json()["best_checkpoint"] == str(best.resolve())
    assert res.to_json()["best_weights"] == "ema"
    assert res.best["ema_checkpoint"].endswith("step-10/ema.safetensors")
    got, _ = read_lora(best)
    want, _ = read_lora(_as_lora(transformer, ema[10], tmp_path / "ref"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert "best checkpoint step 10 (EMA)" in str(res) and str(best.resolve()) in str(res)
    page = (out / "index.html").read_text()
    assert "step 10 (EMA)" in page and "EMA held-out loss" in page
    assert "best (step 10 EMA)" in page and "last (step 20)" in page  # the pictures: the EMA's and the last LoRA's
    # step 10's EMA is a zero delta: its picture is the base's to the pixel, the raw LoRA's is not
    grid = np.asarray(Image.open(out / "grid.png").convert("RGB"))
    base_tile, best_tile, last_tile = (grid[2 * LABEL_H: LABEL_H + TILE + LABEL_H, c * TILE:(c + 1) * TILE]
                                       for c in range(grid.shape[1] // TILE - 3, grid.shape[1] // TILE))
    assert np.array_equal(best_tile, base_tile) and not np.array_equal(last_tile, base_tile)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["checkpoints"]["best"]["weights"] == "ema"
    # the loss section (base vs best) is the EMA's numbers
    assert metrics["loss"]["overall"]["lora"] == pytest.approx(c["base"]["overall"], rel=1e-6)

    # the LoRA written removed: the report names a file that is not there, so it is not current
    shutil.rmtree(best)
    capsys.readouterr()
    again = ev.run(pictured, root / "store", tiny_edit_model, ckpts, out, skip_if_done=True)
    assert not again.up_to_date and again.evaluated == 0 and (best / "pytorch_lora_weights.safetensors").is_file()
    assert "best EMA written as a LoRA" in "".join(capsys.readouterr())


def test_a_best_ema_evaluated_in_bf16_is_written_with_the_ema_files_float32_values(model_store, tiny_edit_model,
                                                                                      tmp_path):
    """Evaluate's adapter holds its dtype (bf16 here, as on a GPU); the best EMA's LoRA is the EMA file's float32
    values, as RUN/lora_ema and every checkpoint's lora/ hold them. Before, the bf16 adapter's (one more rounding)."""
    root, transformer = model_store
    # step 10's EMA: B zero (the base: the best in any dtype), A off the raw one by float32 values bf16 cannot hold
    ckpts, ema = _run(root, transformer, "run_ema_bf16", {10: (RAW, 0.0, 2), 20: (RAW, None, 4)})
    res = ev.run(EvaluateConfig(**{**CFG, "dtype": "bfloat16"}), root / "store", tiny_edit_model, ckpts,
                 tmp_path / "report")
    assert (res.best["step"], res.best["weights"]) == (10, "ema")
    got, _ = read_lora(tmp_path / "report" / BEST_LORA)
    want, _ = read_lora(_as_lora(transformer, ema[10], tmp_path / "ref"))
    assert any(not torch.equal(v, v.bfloat16().float()) for v in want.values())  # the case is one bf16 rounds
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_best_is_the_raw_lora_when_its_loss_is_lower_or_equal(model_store, tiny_edit_model, tmp_path):
    root, transformer = model_store
    # step 10's raw LoRA a zero delta (the base) and its EMA too (a tie: the raw LoRA); step 20 far, raw and EMA
    ckpts, _ = _run(root, transformer, "run_raw_best", {10: (0.0, 0.0, 2), 20: (RAW, None, 4)})
    out = tmp_path / "report"
    (out / BEST_LORA).mkdir(parents=True)  # an earlier report's best EMA LoRA: no longer the best
    (out / "metrics.json").write_text("{}")
    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ckpts, out)
    c = res.metrics["checkpoints"]
    assert c["ema"]["per_step"][0]["overall"] == c["per_step"][0]["overall"]  # a tie, to the bit
    assert (res.best["step"], res.best["weights"]) == (10, "lora")
    assert res.best["path"].endswith("step-10/lora") and res.to_json()["best_checkpoint"] == res.best["path"]
    assert not (out / BEST_LORA).exists()
    assert "best checkpoint step 10 (LoRA):" in str(res)


def test_a_report_made_before_the_ema_was_scored_is_recomputed_with_one_line(model_store, tiny_edit_model, tmp_path,
                                                                             monkeypatch, capsys):
    root, transformer = model_store
    ckpts, _ = _run(root, transformer, "run_old_report", {10: (RAW, 0.0, 2), 20: (RAW, None, 4)})
    out = tmp_path / "report"
    with monkeypatch.context() as m:  # the release before: the raw LoRAs only
        m.setattr(ev, "ema_checkpoints", lambda cfg, checkpoints, ranks: ([], {}), raising=False)
        old = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ckpts, out)
    assert "ema" not in old.metrics["checkpoints"] and old.best.get("weights", "lora") == "lora"
    capsys.readouterr()
    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ckpts, out, skip_if_done=True)
    err = "".join(capsys.readouterr())
    lines = [line for line in err.splitlines() if line.startswith("evaluate: the report in")]
    assert len(lines) == 1, err
    assert "checkpoints' EMA (train.ema_decay) scored False -> True" in lines[0]
    assert "no checkpoint evaluated again); scoring the EMA of 2 of 2 checkpoints" in lines[0]
    assert res.evaluated == 0 and (res.best["step"], res.best["weights"]) == (10, "ema")
    # evaluate.score_ema: false scores the raw LoRAs only (the report written again, nothing evaluated)
    off = ev.run(EvaluateConfig(**CFG, score_ema=False), root / "store", tiny_edit_model, ckpts, out, skip_if_done=True)
    assert "ema" not in off.metrics["checkpoints"] and off.best["weights"] == "lora" and off.evaluated == 0


def test_a_run_without_ema_keeps_its_report_current_and_writes_nothing_of_ema(model_store, tiny_edit_model, tmp_path):
    root, transformer = model_store
    ckpts = []
    for step, raw in ((10, RAW), (20, 0.0)):
        write_checkpoint(transformer, root / "run_plain" / "checkpoints" / f"step-{step}", raw)
        ckpts.append((step, root / "run_plain" / "checkpoints" / f"step-{step}" / "lora"))
    out = tmp_path / "report"
    res = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ckpts, out)
    assert "ema" not in res.metrics["checkpoints"] and not (out / EMA_LOSSES).exists()
    assert res.to_json()["best_weights"] == "lora" and res.to_json()["ema_losses"] is None
    # evaluate.score_ema at its default enters no hash: the settings' fingerprint is the release before's
    assert EvaluateConfig(**CFG).fingerprint() == "714d07c2b1f80432"
    # a report of the release before (no `weights` in its best) stays current: nothing is evaluated or rewritten
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["checkpoints"]["best"].pop("weights", None)
    metrics.pop("checksum", None)  # edited by hand: unsealed, as a report of an earlier release
    (out / "metrics.json").write_text(json.dumps(metrics))
    before = (out / "metrics.json").stat().st_mtime_ns
    again = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ckpts, out, skip_if_done=True)
    assert again.up_to_date and (out / "metrics.json").stat().st_mtime_ns == before


def test_a_trained_runs_last_ema_point_is_its_lora_ema_evaluated_alone(tiny_edit_model, tmp_path):
    """End to end: a real training with train.ema_decay (checkpoints sealed with their ema.safetensors); the EMA
    curve's last step against single-LoRA evaluate of the trainer's own RUN/lora_ema (alpha folded, the same
    delta), and the raw curve's against RUN/lora."""
    from pipeline.config import load_config
    from pipeline.orchestrate import kept_checkpoints
    from stages.evaluate import stage as single
    from stages.train.recipe import run as train

    make_train_store(tmp_path / "store", tiny_edit_model, mixed_specs(4, 4, masks=True))
    cfg = load_config(None, {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 5e-2,
                             "train.lora.rank": 4, "train.lora.alpha": 2.0, "train.sigma.sampling": "uniform",
                             "train.max_steps": 4, "train.checkpoint_every": 2, "train.ema_decay": 0.9})
    train(cfg, tmp_path / "store", tiny_edit_model, tmp_path / "run")
    ckpts = kept_checkpoints(tmp_path / "run")
    assert [s for s, _ in ckpts] == [2, 4] and all((p.parent / "ema.safetensors").is_file() for _, p in ckpts)
    res = ev.run(EvaluateConfig(**CFG), tmp_path / "store", tiny_edit_model, ckpts, tmp_path / "report")
    c = res.metrics["checkpoints"]
    ema_last, raw_last = c["ema"]["per_step"][-1]["overall"], c["per_step"][-1]["overall"]
    alone = {name: single.run(EvaluateConfig(**CFG), tmp_path / "store", tiny_edit_model, tmp_path / "run" / name,
                              tmp_path / f"alone-{name}").metrics["loss"]["overall"]["lora"]
             for name in ("lora_ema", "lora")}
    assert abs(ema_last - raw_last) > 1e-4  # the EMA is other weights than the LoRA it averages
    assert ema_last == pytest.approx(alone["lora_ema"], rel=1e-5)
    assert raw_last == pytest.approx(alone["lora"], rel=1e-5)


def test_two_ranks_score_the_ema_as_one_process_does(model_store, tiny_edit_model, tmp_path):
    """Under `pipeline launch` (two gloo processes) the EMA rows are shared between the ranks as the raw ones are:
    the one-process numbers, the same best, said once."""
    import sys

    import warm_start
    from test_evaluate_checkpoints_ranks import _env

    root, transformer = model_store
    ckpts, _ = _run(root, transformer, "run_ranks", {10: (RAW, 0.0, 2), 20: (RAW, None, 4)})
    one = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ckpts, tmp_path / "one")
    args = ["run", "evaluate", "--all-checkpoints", "--set", f"paths.run={root / 'run_ranks'}", "--store",
            str(root / "store"), "--model", tiny_edit_model, "--out", str(tmp_path / "two"), "--num-samples", "0",
            "--device", "cpu", "--set", "evaluate.noise_seeds=[0, 1]", "--set", "evaluate.timesteps=[0.3, 0.7]",
            "--set", "evaluate.batch_size=4"]
    proc = warm_start.run([sys.executable, "-m", "pipeline.cli", "launch", "--standalone", "--nproc-per-node", "2",
                           *args], env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("best checkpoint step 10 (EMA)") == 1, proc.stdout[-2000:]
    a = xr.open_zarr(tmp_path / "one" / EMA_LOSSES / GROUP).sortby("step")
    b = xr.open_zarr(tmp_path / "two" / EMA_LOSSES / GROUP).sortby("step")
    assert list(b.step.values) == [10, 20]
    np.testing.assert_allclose(b.loss.values, a.loss.values, rtol=1e-5, atol=1e-7)
    assert json.loads((tmp_path / "two" / "metrics.json").read_text())["checkpoints"]["best"]["weights"] == "ema"
    assert one.best["weights"] == "ema"


def test_compare_shows_each_runs_ema_curve_and_the_best_its_report_names(model_store, tiny_edit_model, tmp_path):
    """`pipeline compare` read only the raw curve: a run whose report's best is an EMA was named its best raw
    checkpoint. Now its EMA curve is drawn and listed beside the raw one (the report's numbers), and its best is
    the report's, step and weights; a run without EMA compares as before."""
    import csv

    from stages.evaluate.compare import write_compare

    root, transformer = model_store
    # run A: raw LoRAs far, step 10's EMA the base (the report's best: step 10, EMA); run B: no EMA files
    ckpts, _ = _run(root, transformer, "run_cmp_ema", {10: (RAW, 0.0, 2), 20: (RAW, None, 4)})
    plain = []
    for step, raw in ((10, RAW), (20, 0.0)):
        write_checkpoint(transformer, root / "run_cmp_plain" / "checkpoints" / f"step-{step}", raw)
        plain.append((step, root / "run_cmp_plain" / "checkpoints" / f"step-{step}" / "lora"))
    a, b = tmp_path / "a", tmp_path / "b"
    ra = ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, ckpts, a)
    ev.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, plain, b)
    assert (ra.best["step"], ra.best["weights"]) == (10, "ema")

    res = write_compare([str(a), str(b)], tmp_path / "cmp")
    ca, cb = (json.loads((r / "metrics.json").read_text())["checkpoints"] for r in (a, b))
    # before, the raw curve's best: step 10's raw LoRA, worse than the base the EMA's loss is
    assert res.to_json()["runs"][0]["best_loss"] == pytest.approx(ca["best"]["loss"], rel=1e-9)
    assert "a: best step 10 (EMA)" in str(res), str(res)
    assert res.to_json()["runs"][0]["best_weights"] == "ema" and "best_weights" not in res.to_json()["runs"][1]
    assert res.to_json()["runs"][0]["best_checkpoint"] == ca["best"]["ema_checkpoint"]
    run_a, run_b = res.runs
    assert run_a.ema.steps == ca["ema"]["steps"] == [10, 20]
    np.testing.assert_allclose(run_a.ema.overall, [p["overall"] for p in ca["ema"]["per_step"]], rtol=1e-9)
    np.testing.assert_allclose(run_a.overall, [p["overall"] for p in ca["per_step"]], rtol=1e-9)
    assert run_b.ema is None
    # each run's best is its report's: step, weights and loss
    for run, c in ((run_a, ca), (run_b, cb)):
        best = run.best_point
        assert (best["step"], best["weights"]) == (c["best"]["step"], c["best"]["weights"])
        assert best["loss"] == pytest.approx(c["best"]["loss"], rel=1e-9)

    # the CSV: the EMA rows beside the raw ones, labelled by a weights column, the best marked on the EMA's row
    with open(tmp_path / "cmp" / "curves.csv") as f:
        rows = list(csv.DictReader(f))
    ema_rows = [r for r in rows if r["run"] == "a" and r["weights"] == "ema"]
    assert [int(r["step"]) for r in ema_rows] == [10, 20]
    np.testing.assert_allclose([float(r["loss"]) for r in ema_rows], [p["overall"] for p in ca["ema"]["per_step"]],
                               rtol=1e-9)
    assert [(r["run"], r["step"], r["weights"]) for r in rows if r["best"] == "best"] == \
        [("a", "10", "ema"), ("b", str(cb["best"]["step"]), "lora")]
    page = (tmp_path / "cmp" / "index.html").read_text()
    assert "a (EMA)" in page and "<td>EMA</td>" in page

    # reports without EMA data: the table and page as before (no weights column). A's report written again
    # without the EMA (evaluate.score_ema: false) leaves A/ema-losses on disk, no longer the report's: not read
    rc = ev.run(EvaluateConfig(**CFG, score_ema=False), root / "store", tiny_edit_model, ckpts, a, skip_if_done=True)
    assert "ema" not in rc.metrics["checkpoints"] and (a / EMA_LOSSES / GROUP).is_dir()
    old = write_compare([str(b), str(a)], tmp_path / "cmp-old")
    assert (old.runs[1].best_point["step"], old.runs[1].best_point["weights"]) == (rc.best["step"], "lora")
    assert old.runs[1].best_point["loss"] == pytest.approx(rc.best["loss"], rel=1e-9)
    header = (tmp_path / "cmp-old" / "curves.csv").read_text().splitlines()[0]
    assert header == "run,step,checkpoint,loss,loss_inside,loss_outside,best,on_disk"
    assert all(r.ema is None for r in old.runs) and "weights" not in (tmp_path / "cmp-old" / "index.html").read_text()


def test_a_run_without_checkpoints_says_its_lora_ema_is_not_scored(model_store, tiny_edit_model, tmp_path, capsys):
    """A run without checkpoints is evaluated on RUN/lora alone (`run all`, `evaluate --run`): RUN/lora_ema was
    ignored without a word. Now one line names it and how to score it; the report is RUN/lora's, as before."""
    from stages.evaluate import stage as single

    root, transformer = model_store
    run = tmp_path / "run"
    write_checkpoint(transformer, run, 0.0)  # RUN/lora, sealed as train seals it
    capsys.readouterr()
    alone = single.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, run / "lora", tmp_path / "plain")
    assert "is not scored" not in "".join(capsys.readouterr())  # no RUN/lora_ema: nothing said
    shutil.copytree(run / "lora", run / "lora_ema")
    res = single.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, run / "lora", tmp_path / "report")
    lines = [line for line in "".join(capsys.readouterr()).splitlines() if "lora_ema" in line]
    assert lines == [f"evaluate: {run / 'lora_ema'} (the run's EMA, train.ema_decay) is not scored: evaluate scores "
                     f"{run / 'lora'} alone; score it with `pipeline run evaluate --lora {run / 'lora_ema'} --out "
                     "ANOTHER_REPORT` (`--all-checkpoints` scores each checkpoint's EMA beside its LoRA)"]
    assert res.metrics["loss"]["overall"] == alone.metrics["loss"]["overall"]  # RUN/lora's numbers
    # said again when the report is current (nothing evaluated), and not for RUN/lora_ema itself
    again = single.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, run / "lora", tmp_path / "report",
                       skip_if_done=True)
    assert again.up_to_date and "lora_ema (the run's EMA" in "".join(capsys.readouterr())
    single.run(EvaluateConfig(**CFG), root / "store", tiny_edit_model, run / "lora_ema", tmp_path / "ema-report")
    assert "is not scored" not in "".join(capsys.readouterr())
