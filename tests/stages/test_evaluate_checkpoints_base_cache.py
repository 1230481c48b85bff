"""`evaluate --all-checkpoints` and the base losses kept by their inputs (`stages.evaluate.base_losses`, the
single-LoRA cache). After `run all` trained afresh, the old report went into the kept run and its base caches were
linked into the new report folder, but the new (empty) loss array computed the base pass (LoRA off) again though
no input of it changed: a full extra pass over the val set. Now an array without base losses takes them from
OUT/base-losses.safetensors when recorded under the same key, and records them there when it computes them."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import xarray as xr

from pipeline.orchestrate import REPORT_IN_KEPT_RUN, _report_back
from schemas.config import EvaluateConfig
from stages.evaluate import base_losses, checkpoints as ev, loss_pass
from store.loss_array import GROUP
from test_evaluate_checkpoints import CFG, _ckpts, run_and_store  # noqa: F401 (the module fixture)


def _counting(monkeypatch) -> list[str]:
    passes, real = [], loss_pass.loss_grid
    monkeypatch.setattr(loss_pass, "loss_grid", lambda *a, **k: (passes.append(a[5] if len(a) > 5 else k.get("desc")),
                                                           real(*a, **k))[1])
    return passes


def _base(out) -> np.ndarray:
    return xr.open_zarr(out / GROUP).base_loss.values


def test_a_fresh_training_reuses_the_kept_reports_base_losses(run_and_store, tiny_edit_model, tmp_path,
                                                              monkeypatch):
    root, cfg = run_and_store, EvaluateConfig(**CFG)
    passes = _counting(monkeypatch)
    first = tmp_path / "report"
    ev.run(cfg, root / "store", tiny_edit_model, _ckpts(root), first)
    assert passes.count("held-out loss (base)") == 1 and (first / base_losses.FILE).is_file()

    # `run all` after a changed train setting: the report goes into the kept run, its base caches come back
    kept = tmp_path / "run.previous" / "1"
    kept.mkdir(parents=True)
    os.rename(first, kept / REPORT_IN_KEPT_RUN)
    (tmp_path / "run").mkdir()
    _report_back(first, tmp_path / "run", SimpleNamespace(kept_previous=kept))
    assert not (first / GROUP).exists() and (first / base_losses.FILE).is_file()

    passes.clear()
    res = ev.run(cfg, root / "store", tiny_edit_model, _ckpts(root), first)
    assert res.evaluated == 3 and passes.count("held-out loss (base)") == 0, passes
    # the numbers a fresh base pass gives, to the bit (an empty folder: nothing to reuse)
    fresh = tmp_path / "fresh"
    ev.run(cfg, root / "store", tiny_edit_model, _ckpts(root), fresh)
    assert passes.count("held-out loss (base)") == 1
    np.testing.assert_array_equal(_base(first), _base(fresh))
    np.testing.assert_array_equal(_base(first), _base(kept / REPORT_IN_KEPT_RUN))
    assert res.metrics["checkpoints"]["base"] == ev.run(cfg, root / "store", tiny_edit_model, _ckpts(root),
                                                        fresh).metrics["checkpoints"]["base"]

    # an input of the base losses changed (the σ grid: a new array): computed, and recorded under its key
    passes.clear()
    other = cfg.model_copy(update={"timesteps": [0.3, 0.5]})
    ev.run(other, root / "store", tiny_edit_model, _ckpts(root), first)
    assert passes.count("held-out loss (base)") == 1
    # a damaged file: computed again, not reused
    os.rename(first, tmp_path / "aside")
    first.mkdir()
    data = bytearray((tmp_path / "aside" / base_losses.FILE).read_bytes())
    data[-3] ^= 0x10
    (first / base_losses.FILE).write_bytes(bytes(data))
    passes.clear()
    ev.run(other, root / "store", tiny_edit_model, _ckpts(root), first)
    assert passes.count("held-out loss (base)") == 1
    np.testing.assert_array_equal(_base(first), _base(tmp_path / "aside"))


def test_a_single_lora_reports_base_losses_serve_all_checkpoints(run_and_store, tiny_edit_model, tmp_path,
                                                                 monkeypatch):
    """One cache, one key: the base pass single-LoRA evaluate recorded (LoRA attached, switched off) is the one
    --all-checkpoints computes (no adapter yet), to the bit."""
    from stages.evaluate import stage

    root, cfg, out = run_and_store, EvaluateConfig(**CFG), tmp_path / "report"
    stage.run(cfg, root / "store", tiny_edit_model, dict(_ckpts(root))[10], out)
    passes = _counting(monkeypatch)
    ev.run(cfg, root / "store", tiny_edit_model, _ckpts(root), out)
    assert passes.count("held-out loss (base)") == 0, passes
    ev.run(cfg, root / "store", tiny_edit_model, _ckpts(root), tmp_path / "fresh")
    assert passes.count("held-out loss (base)") == 1
    np.testing.assert_array_equal(_base(out), _base(tmp_path / "fresh"))
