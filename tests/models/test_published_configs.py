"""`pipeline plan` for the published hub ids works offline from the component configs shipped in
models/published/ (HF_HUB_OFFLINE is set for the whole suite: before them the hub lookup failed)."""

from __future__ import annotations

import json
import re

import pytest
from accelerate import init_empty_weights

from models.memory_plan import PUBLISHED, component_params, config_root, transformer_counts


@pytest.mark.parametrize("hub_id", sorted(PUBLISHED))
def test_published_counts_match_the_real_architecture(hub_id):
    from diffusers import QwenImageTransformer2DModel

    from models.full_width import FULL_TRANSFORMER

    with init_empty_weights():  # the widths this project knows from the released models (models/full_width.py)
        ref = QwenImageTransformer2DModel(num_layers=60, **FULL_TRANSFORMER)
    c = transformer_counts(hub_id)
    assert c.params == sum(p.numel() for p in ref.parameters())
    assert 20.0e9 < c.params < 20.6e9 and c.blocks == 60 and c.width == 3072
    assert 8.2e9 < component_params(hub_id, "text_encoder") < 8.4e9  # Qwen2.5-VL-7B with its 152064 vocabulary
    assert 1.0e8 < component_params(hub_id, "vae") < 1.5e8
    zero_cond = json.loads((config_root(hub_id) / "transformer" / "config.json").read_text()).get("zero_cond_t", False)
    assert zero_cond == hub_id.endswith("2511")


def test_plan_cli_offline_for_a_hub_id():
    from typer.testing import CliRunner

    from pipeline.cli import app

    result = CliRunner().invoke(app, ["plan", "--model", "Qwen/Qwen-Image-Edit-2509", "--gpu-memory", "80"])
    assert "transformer 20.43 B params" in result.output, result.output
    assert "train" in result.output and "DOES NOT FIT" in result.output  # batch 4 at 1 MP, no checkpointing


def test_a_local_folder_wins_over_the_shipped_configs(tmp_path, monkeypatch):
    (tmp_path / "Qwen" / "Qwen-Image-Edit").mkdir(parents=True)
    (tmp_path / "Qwen" / "Qwen-Image-Edit" / "model_index.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert config_root("Qwen/Qwen-Image-Edit") == (tmp_path / "Qwen" / "Qwen-Image-Edit").resolve()


def test_plan_uses_the_token_budget_when_set(tmp_path):
    """train.max_tokens_per_batch: a micro-batch computes up to the budget's tokens whatever batch_size says, so
    plan's train peak is that of the budget (it planned batch_size x seq: 68,992 tokens for a 98,304 budget,
    0.70x the activations)."""
    from typer.testing import CliRunner

    from models import memory_plan as mp
    from pipeline.cli import app

    config = tmp_path / "budget.yaml"
    config.write_text("train:\n  max_tokens_per_batch: 98304\n  gradient_checkpointing: true\n")
    result = CliRunner().invoke(app, ["plan", "--model", "Qwen/Qwen-Image-Edit-2509", "--config", str(config)])
    assert result.exit_code == 0, result.output
    budget = mp.train_plan("Qwen/Qwen-Image-Edit-2509", "bfloat16", "none", 1, 98304, True, 16)
    fixed = mp.train_plan("Qwen/Qwen-Image-Edit-2509", "bfloat16", "none", 4, 17248, True, 16)
    train_line = next(line for line in result.output.splitlines() if line.strip().startswith("train "))
    assert mp.gib(budget.total) in train_line and mp.gib(fixed.total) not in train_line, result.output
    assert "token budget 98304 per batch" in result.output


@pytest.mark.parametrize("hub_id", ["Qwen/Qwen-Image-Edit", "Qwen/Qwen-Image-Edit-2509"])
def test_plan_counts_the_vl_image_tokens_of_the_prompt(hub_id):
    """The transformer's text sequence is the prompt embeddings, which hold the VLM's image tokens of every
    control (Qwen2.5-VL: patch 14 x merge 2 = 28 px per token): Plus at diffusers' CONDITION_IMAGE_SIZE, Edit
    (one control) at the VAE view. plan left them out (2509: 16684 tokens for 17248) and planned Edit with
    max_controls' 3 controls (16684 for 9829)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE
    from typer.testing import CliRunner

    from pipeline.cli import app

    vision = json.loads((config_root(hub_id) / "text_encoder" / "config.json").read_text())["vision_config"]
    px = vision["patch_size"] * vision["spatial_merge_size"]
    text, target = 300, 1024 * 1024 // 256  # plan's default caption tokens; the default 1024² target
    if hub_id.endswith("2509"):
        expected = target + 3 * VAE_IMAGE_SIZE // 256 + text + 3 * (CONDITION_IMAGE_SIZE // px**2)
    else:  # Edit (v1): one control, which the VLM sees as the VAE does (its 1024² view)
        expected = target + VAE_IMAGE_SIZE // 256 + text + VAE_IMAGE_SIZE // px**2
    result = CliRunner().invoke(app, ["plan", "--model", hub_id])
    assert result.exit_code == 0, result.output
    assert f"{expected} tokens per training sample" in result.output, result.output


def test_plan_with_offload_counts_the_checkpointing_the_trainer_turns_on(tiny_edit_model):
    """`train.offload: blocks` turns gradient checkpointing on in the trainer (whatever
    train.gradient_checkpointing says): the plan's activations are the checkpointed ones (it planned every
    block's saved tensors: 283 GiB at 1 MP batch 4 where the run keeps ~15 GiB, and said to offload does not fit)."""
    from typer.testing import CliRunner

    from models import memory_plan as mp
    from pipeline.cli import app
    from pipeline.config import load_config
    import torch

    from stages.train.build import setup_transformer

    cfg = load_config(None, {"train.offload": "blocks", "train.lora.rank": 4})
    assert not cfg.train.gradient_checkpointing
    assert setup_transformer(tiny_edit_model, cfg.train, torch.device("cpu")).is_gradient_checkpointing
    hub = "Qwen/Qwen-Image-Edit-2509"
    result = CliRunner().invoke(app, ["plan", "--model", hub, "--set", "train.offload=blocks"])
    tokens = int(re.search(r"(\d+) tokens per training sample", result.output).group(1))
    off = mp.train_plan(hub, "bfloat16", "none", 4, tokens, False, 16, offload="blocks")
    ckpt = mp.train_plan(hub, "bfloat16", "none", 4, tokens, True, 16, offload="blocks")
    assert off.parts == ckpt.parts
    assert off.parts["activations"] < mp.train_plan(hub, "bfloat16", "none", 4, tokens, False, 16).parts["activations"] / 10
    train_line = next(line for line in result.output.splitlines() if line.strip().startswith("train "))
    assert f"activations {mp.gib(ckpt.parts['activations'])}" in train_line, result.output
