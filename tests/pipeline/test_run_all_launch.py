"""`pipeline launch --nproc-per-node 2 run all`: both ranks ran resize-bucket into the same store and one stopped
on the other's write lock ("table 'images' (rank 0) is being written by pid ..."). Now resize-bucket runs on rank 0
while the other rank waits (`models.collective.main_alone`), encode / train / evaluate run distributed as they do
launched alone, rank 0 prints the stage lines; a failure on rank 0 stops both ranks with its one line. Two gloo
processes on the CPU, as the other launch tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

import warm_start

REPO = Path(__file__).resolve().parents[2]


def _config(tmp: Path, model: str, source: Path) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["paths"] = {"source": str(source), "store": str(tmp / "store"), "model": model,
                    "run": str(tmp / "run"), "report": str(tmp / "report")}
    # split by key: the split these demo samples were chosen for (the pictures split puts none of them in 'val')
    cfg["resize"].update(target_area=64 * 64, control_vae_area=64 * 64, val_fraction=0.3, split_by="key")
    cfg["train"].update(max_steps=4, checkpoint_every=2, keep_checkpoints=2, batch_size=2)
    cfg["evaluate"].update(num_samples=2, num_inference_steps=2, noise_seeds=[0], timesteps=[0.3, 0.7])
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(config: Path, log: Path) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("WORLD_SIZE", None)
    # launcher and ranks started warm (tests/warm_start.py), their output into files (a full pipe blocks the ranks)
    # --standalone: a free port (torchrun's default 29500 may be another test's on a shared machine)
    done = warm_start.run([sys.executable, "-m", "pipeline.cli", "launch", "--standalone", "--nproc-per-node", "2",
                           "run", "all", "--config", str(config)], env=env, timeout=900)
    log.write_text(done.stdout + done.stderr)
    return done.returncode, done.stdout + done.stderr


def test_run_all_under_a_launcher_runs_every_stage_on_two_ranks(tiny_plus_model, tmp_path):
    from pipeline.demo_data import make_demo_data
    from store import Store

    make_demo_data(tmp_path / "data", n=12, fmt="folder", max_controls=2, seed=1)
    code, out = _launch(_config(tmp_path, tiny_plus_model, tmp_path / "data"), tmp_path / "launch.log")
    assert code == 0, out[-4000:]
    assert out.count("== resize-bucket") == 1 and out.count("== evaluate") == 1, out[-4000:]  # rank 0's lines
    # the stages' own lines too (each rank printed its `encode-text: float32 on cpu (set)`: 8 ranks, 8 copies)
    lines = out.splitlines()
    for stage in ("encode-text", "encode-vae"):
        assert sum(line.startswith(f"{stage}: float32 on cpu") for line in lines) == 1, out[-4000:]
    assert "is being written by pid" not in out and "Traceback" not in out, out[-4000:]
    assert Store(tmp_path / "store").versions("images") == [1]
    with Store(tmp_path / "store").reader("images") as images:
        samples = len(images)
    for stage, table in (("encode-text", "text"), ("encode-vae", "vae")):  # every rank's share, not rank 0's
        assert f"{stage} [2 ranks]: table '{table}' v1: encoded {samples}, " in out, out[-4000:]
    for step in (2, 4):  # trained by both ranks
        record = json.loads((tmp_path / "run" / "checkpoints" / f"step-{step}" / "resume.json").read_text())
        assert record["world_size"] == 2, record
    assert json.loads((tmp_path / "report" / "metrics.json").read_text())["loss"]["overall"]["n"] >= 1
    assert out.count("held-out loss (val,") == 1, out[-4000:]


def test_a_resize_failure_on_rank_0_stops_both_ranks_with_its_line(tiny_plus_model, tmp_path):
    (tmp_path / "empty").mkdir()
    code, out = _launch(_config(tmp_path, tiny_plus_model, tmp_path / "empty"), tmp_path / "launch.log")
    assert code == 1, out[-4000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("error: source "))
    assert out.count(line) == 2 and "has no target/ folder" in line, out[-4000:]  # each rank's, the same
    assert "Traceback" not in out and "error: pipeline.cli stopped:" in out, out[-4000:]


def test_run_all_under_a_launcher_refuses_a_store_url_on_every_rank(monkeypatch, tmp_path):
    from pipeline.orchestrate import run_all
    from pipeline.config import load_config
    from schemas.errors import UserError

    cfg = load_config(None, {"paths.source": str(tmp_path), "paths.store": "s3://bucket/store", "paths.model": "m",
                             "paths.run": str(tmp_path / "run"), "paths.report": str(tmp_path / "report")})
    for rank in ("0", "1"):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(UserError, match=r"on a store URL \(s3://bucket/store\) runs in one process.*launched as 2"):
            run_all(cfg, log=lambda m: None)
