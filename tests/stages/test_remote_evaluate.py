"""`pipeline run evaluate --store s3://...` against the S3 test server: the tables pulled into the cache, checked,
and the held-out losses are exactly those of an evaluate of the local store the URL was pushed from."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from models.loading import load_component
from models.lora import add_lora, save_lora
from pipeline.cli import app
from schemas.config import LoraConfig
from store.remote_push import push
from train_store import make_train_store, mixed_specs


def _evaluate(store: str, model: str, lora: Path, out: Path, *extra: str) -> dict:
    args = ["run", "evaluate", "--store", store, "--model", model, "--lora", str(lora), "--out", str(out),
            "--set", "evaluate.device=cpu", "--set", "evaluate.num_samples=0", "--set", "evaluate.noise_seeds=[0]",
            "--set", "evaluate.timesteps=[0.5]", *extra]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads((out / "metrics.json").read_text())["loss"]


def test_evaluate_on_a_store_url_gives_the_local_losses(s3_env, tiny_edit_model, tmp_path: Path) -> None:
    local = tmp_path / "store"
    make_train_store(local, tiny_edit_model, mixed_specs(2, 3))
    transformer = load_component(tiny_edit_model, "transformer")
    add_lora(transformer, LoraConfig(rank=4))
    save_lora(transformer, tmp_path / "lora")
    push(local, s3_env.url("eval"))

    cache = tmp_path / "cache"
    remote = _evaluate(s3_env.url("eval"), tiny_edit_model, tmp_path / "lora", tmp_path / "report-url",
                       "--cache-dir", str(cache))
    mine = _evaluate(str(local), tiny_edit_model, tmp_path / "lora", tmp_path / "report-local")
    assert remote["overall"]["n"] == mine["overall"]["n"] > 0
    assert remote["overall"] == mine["overall"] and remote["per_sample"] == mine["per_sample"]
    assert [p for p in cache.iterdir() if p.is_dir()]  # read through the cache
