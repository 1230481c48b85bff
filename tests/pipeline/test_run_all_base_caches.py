"""`pipeline run all` after a changed train setting: train keeps the old run (its report moved inside it) and trains
afresh; the base column (LoRA off) has none of its inputs changed, so the kept report's base images and base losses
are linked into the new report folder, where evaluate reuses them by their recorded inputs. Before, every changed
train setting generated the base images and computed the base held-out losses again (minutes per rerun at scale)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from PIL import Image

from pipeline.orchestrate import REPORT_IN_KEPT_RUN, _report_back
from stages.evaluate import base_images, base_losses
from stages.evaluate.stage import check_report_folder


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
