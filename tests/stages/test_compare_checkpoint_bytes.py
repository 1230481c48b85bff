"""`pipeline compare` names a run's best checkpoint only where a file holds the bytes its numbers are of (the
array's `lora_sha256`), and finds a kept run's checkpoints in that run (RUN.previous/N/checkpoints), not at the
paths recorded before the keep moved them - where the new run's checkpoints of the same steps now are. Arrays
written directly, checkpoint files of a few bytes (no model)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from stages.evaluate.compare import write_compare
from store.loss_array import Axes, LossStore

KEYS = [f"{i:032x}" for i in range(4)]
SETTINGS = {"tables": {"text": "content:t", "vae": "content:v"}, "model_fingerprint": "m",
            "evaluate": {"noise_seeds": [0], "timesteps": [0.5], "max_loss_samples": None, "lora_scale": 1.0,
                         "dtype": "float32", "attention_backend": "native", "quantize_base": "none",
                         "on_damaged": "stop"}, "evaluation_revision": 1}


def _run(run: Path, report: Path, losses: dict[int, float], tag: str) -> None:
    """RUN/checkpoints/step-N/lora (bytes of their own) and REPORT/losses.zarr recording each one's loss under its
    path and sha256, as evaluate --all-checkpoints does."""
    axes = Axes(KEYS, ["16x16"] * len(KEYS), [0], [0.5])
    group = LossStore(report, f"fp {tag}", axes, SETTINGS)
    group.write_base(np.full(axes.shape, 2.0))
    for step, loss in losses.items():
        lora = run / "checkpoints" / f"step-{step}" / "lora"
        lora.mkdir(parents=True)
        data = f"{tag} step {step}".encode()
        (lora / "pytorch_lora_weights.safetensors").write_bytes(data)
        group.append(step, str(lora.resolve()), hashlib.sha256(data).hexdigest(), np.full(axes.shape, loss))


def _kept_and_new(tmp_path: Path, prune_old_best: bool = False) -> tuple[Path, Path]:
    """runs/a evaluated into its report, then kept as `run all` keeps it (the report moved into the run, the run
    renamed to runs/a.previous/1-...), and a new run trained into runs/a at the same steps, evaluated into
    reports/a. The old run's best is step 20, the new run's step 10."""
    run = tmp_path / "runs" / "a"
    _run(run, run / "evaluate-report", {10: 1.5, 20: 1.2}, "old")
    kept = tmp_path / "runs" / "a.previous" / "1-20261123T074400Z"
    kept.parent.mkdir(parents=True)
    os.rename(run, kept)
    if prune_old_best:
        (kept / "checkpoints" / "step-20" / "lora" / "pytorch_lora_weights.safetensors").unlink()
    _run(run, tmp_path / "reports" / "a", {10: 1.1, 20: 1.3}, "new")
    return kept, tmp_path / "reports" / "a"


def test_a_kept_runs_best_is_its_own_checkpoint_not_the_new_runs_at_that_step(tmp_path):
    """Before, compare named runs/a/checkpoints/step-20/lora - the new run's step 20, other weights - as the kept
    run's best, on disk."""
    kept, new = _kept_and_new(tmp_path)
    runs = write_compare([str(kept), str(new)], tmp_path / "cmp").to_json()["runs"]
    assert runs[0]["best_step"] == 20
    assert runs[0]["best_checkpoint"] == str((kept / "checkpoints" / "step-20" / "lora").resolve())
    assert runs[1]["best_step"] == 10
    assert runs[1]["best_checkpoint"] == str((tmp_path / "runs" / "a" / "checkpoints" / "step-10" / "lora").resolve())


def test_a_path_holding_other_weights_is_not_named_the_best(tmp_path):
    """The kept run's step 20 file is gone; the new run's step 20 sits at the path the kept report recorded. That
    file is not the weights evaluated: the kept run's best is its step 10, the lowest still on disk (before:
    step 20, at the new run's path)."""
    kept, new = _kept_and_new(tmp_path, prune_old_best=True)
    result = write_compare([str(kept), str(new)], tmp_path / "cmp")
    old = result.to_json()["runs"][0]
    assert old["best_step"] == 10
    assert old["best_checkpoint"] == str((kept / "checkpoints" / "step-10" / "lora").resolve())
    rows = (tmp_path / "cmp" / "curves.csv").read_text().splitlines()
    step_20 = next(r for r in rows if r.startswith(f"{kept.name},20,"))
    assert step_20.endswith(",,no")  # not the best, and not on disk: no file holds its bytes
