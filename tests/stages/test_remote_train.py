"""A store pushed to the S3 test server and pulled back trains exactly as the original (same LoRA, bit for bit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.lora import read_lora
from pipeline.config import load_config
from stages.train.recipe import run
from store.remote_sync import pull, push
from train_store import make_train_store, mixed_specs

pytest.importorskip("s3fs", reason="push/pull to s3:// needs the s3 extra")

CFG = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 2e-3, "train.lora.rank": 4,
       "train.max_steps": 3, "train.warmup_steps": 1}


def test_pulled_store_trains_the_same_lora(s3_env, tiny_edit_model, tmp_path: Path) -> None:
    local = tmp_path / "store"
    make_train_store(local, tiny_edit_model, mixed_specs(6, 2, masks=True))
    push(local, s3_env.url("features"))
    pulled = tmp_path / "pulled"
    summary = pull(s3_env.url("features"), pulled)
    assert sorted(summary.copied) == ["text/v1", "vae/v1"]

    cfg = load_config(None, CFG)
    run(cfg, local, tiny_edit_model, tmp_path / "run-local")
    run(cfg, pulled, tiny_edit_model, tmp_path / "run-pulled")
    a, b = read_lora(tmp_path / "run-local" / "lora")[0], read_lora(tmp_path / "run-pulled" / "lora")[0]
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k
