"""`pipeline run all` after a changed train setting: train keeps the old run (its report moved inside it) and trains
afresh; the base column (LoRA off) has none of its inputs changed, so the kept report's base images and base losses
are linked into the new report folder, where evaluate reuses them by their recorded inputs. Before, every changed
train setting generated the base images and computed the base held-out losses again (minutes per rerun at scale)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
from PIL import Image

from pipeline.orchestrate import REPORT_IN_KEPT_RUN, _report_back
from stages.evaluate import base_images, base_losses
from stages.evaluate.report_folder import check_report_folder


def test_a_fresh_training_takes_the_kept_reports_base_caches(tmp_path):
    kept_report = tmp_path / "run.previous" / "1-T" / REPORT_IN_KEPT_RUN
    kept_report.mkdir(parents=True)
    (kept_report / "metrics.json").write_text("{}")
    picture = Image.new("RGB", (8, 8), (10, 200, 30))
    base_images.write(kept_report / base_images.FOLDER, "group", {"sample:a": picture})
    grid = np.arange(6, dtype=np.float64).reshape(1, 2, 3)
    base_losses.write(kept_report / base_losses.FILE, "key", grid)
    report, run = tmp_path / "report", tmp_path / "run"
    run.mkdir()

    _report_back(report, run, SimpleNamespace(kept_previous=kept_report.parent))
    got = base_images.read(report / base_images.FOLDER, "group", ["sample:a"])
    assert got is not None and np.array_equal(np.asarray(got[0]), np.asarray(picture))
    assert np.array_equal(base_losses.read(report / base_losses.FILE, "key", grid.shape), grid)
    # linked, not copied; the kept report keeps its own; the folder is one evaluate writes its report into
    png = next((report / base_images.FOLDER).glob("*.png"))
    assert png.stat().st_ino == (kept_report / base_images.FOLDER / png.name).stat().st_ino
    assert (kept_report / "metrics.json").is_file() and not (report / "metrics.json").exists()
    check_report_folder(report)

    # caches REPORT holds already (a report given back, or one evaluate wrote) are left as they are
    base_losses.write(report / base_losses.FILE, "other", grid + 1)
    _report_back(report, run, SimpleNamespace(kept_previous=kept_report.parent))
    assert base_losses.read(report / base_losses.FILE, "key", grid.shape) is None
    # no kept run (train up to date or resumed): nothing taken
    other = tmp_path / "other-report"
    _report_back(other, run, SimpleNamespace(kept_previous=None))
    assert not other.exists()


def test_evaluate_after_a_fresh_training_says_the_report_went_with_the_kept_run(tmp_path, monkeypatch, capsys):
    """After train kept the old run (its report inside it) and trained afresh, evaluate computed a new report
    without a word, where every other stage says why it computes again. Now one line naming where the earlier
    report is (RUN.previous/N/evaluate-report); none when train kept nothing, or REPORT still holds a report
    (evaluate says itself whether that one is current)."""
    import stages.evaluate.stage as single
    from pipeline.config import load_config
    from pipeline.orchestrate import Paths, evaluate_run

    run, report = tmp_path / "run", tmp_path / "report"
    (run / "lora").mkdir(parents=True)  # no checkpoints: the one-LoRA evaluate, stood in for below
    kept = tmp_path / "run.previous" / "1-20261203T120000Z"
    (kept / REPORT_IN_KEPT_RUN).mkdir(parents=True)
    (kept / REPORT_IN_KEPT_RUN / "metrics.json").write_text("{}")
    evaluated = []
    monkeypatch.setattr(single, "run", lambda cfg, store, model, lora, out, **k: evaluated.append(lora) or "done")
    cfg = load_config(None, {})
    paths = Paths("src", "store", "model", run, report)

    def said(kept_run) -> list[str]:
        capsys.readouterr()
        assert evaluate_run(cfg, replace(paths, kept=kept_run)) == "done"
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("evaluate:")]

    lines = said(kept)
    assert lines == [f"evaluate: the report in {report} was the previous run's, kept with that run in "
                     f"{kept / REPORT_IN_KEPT_RUN} ({run} holds another run now): evaluating its LoRA {run / 'lora'}"]
    assert said(None) == []  # train resumed or was up to date: nothing kept
    report.mkdir()
    (report / "metrics.json").write_text("{}")
    assert said(kept) == [] and evaluated == [run / "lora"] * 3


def test_a_report_left_in_place_is_named_as_the_kept_runs_by_its_last_checkpoint(tmp_path):
    """`run train --new-run` leaves the old report in the report folder: evaluate's line saying why it is not this
    run's names the kept run it is of (its last checkpoint's bytes found there); nothing, never an error, when no
    kept run holds them or the report does not read as one."""
    import hashlib
    import json

    from models.lora import WEIGHT_NAME
    from pipeline.orchestrate import report_of_kept_run

    run, report = tmp_path / "run", tmp_path / "report"
    report.mkdir()
    kept = {}
    for n, weights in ((1, b"first run"), (2, b"second run")):
        kept[n] = tmp_path / "run.previous" / f"{n}-2026120{n}T000000Z"
        (kept[n] / "checkpoints" / "step-4" / "lora").mkdir(parents=True)
        (kept[n] / "checkpoints" / "step-4" / "lora" / WEIGHT_NAME).write_bytes(weights)
    sha = {n: hashlib.sha256(w).hexdigest() for n, w in ((1, b"first run"), (2, b"second run"), (3, b"other"))}
    whose = report_of_kept_run(run)

    def report_of(steps: list, shas: list) -> str | None:
        (report / "metrics.json").write_text(json.dumps({"checkpoints": {"steps": steps, "lora_sha256": shas}}))
        return whose(report)

    assert report_of([2, 4], [sha[3], sha[1]]) == f"it is the report of the run kept in {kept[1]}"
    assert report_of([2, 4], [sha[1], sha[2]]) == f"it is the report of the run kept in {kept[2]}"
    assert report_of([4], [sha[3]]) is None and report_of([6], [sha[1]]) is None and report_of([], []) is None
    (report / "metrics.json").write_text("[1, 2")
    assert whose(report) is None and whose(tmp_path / "nowhere") is None
