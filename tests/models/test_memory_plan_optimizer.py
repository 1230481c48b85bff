"""`pipeline plan`'s optimizer-state term follows `train.optimizer`: planned from the LoRA's shapes, it equals the
state the real optimizer (stages/train/optimizers.py: torch, bitsandbytes, transformers, prodigyopt) holds after a
step on the tiny model's real adapter. It used to be AdamW's 8 bytes/param for every optimizer (4x adamw8bit's,
half Prodigy's)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from models import memory_plan as mp

OPTIMIZERS = ["adamw", "adamw8bit", "adafactor", "prodigy"]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors, a tensor shared between parameters (bitsandbytes' code tables)
    counted once."""
    seen = {}
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                seen[(v.data_ptr(), v.numel(), v.dtype)] = v.numel() * v.element_size()
    return sum(seen.values())


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_planned_optimizer_state_is_what_the_optimizer_holds_after_a_step(kind, tiny_edit_model):
    from models.loading import load_component
    from models.lora import add_lora, lora_parameters
    from schemas.config import LoraConfig, TrainConfig
    from stages.train.optimizers import build_optimizer

    if kind == "adamw8bit":  # the GPU machine's stack (bench/gpu/rehearse) carries bitsandbytes only on request
        pytest.importorskip("bitsandbytes")
    transformer = load_component(tiny_edit_model, "transformer")
    counts = mp.counts_from_model(transformer)
    add_lora(transformer, LoraConfig(rank=4))
    params = lora_parameters(transformer)
    shapes = [(tuple(p.shape), not p.any()) for p in params]  # (shape, starts at zero: peft's lora_B)
    optimizer = build_optimizer(params, TrainConfig(optimizer=kind, learning_rate=1.0 if kind == "prodigy" else 1e-3))
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    real = state_bytes(optimizer)
    assert mp.optimizer_state_bytes(kind, shapes) == real
    # the plan's own shapes are the adapter's (4 square projections per block): the same bytes
    assert sorted(mp.lora_shapes(counts, 4)) == sorted(shapes)
    plan = mp.train_plan("", "float32", "none", 1, 64, False, 4, counts=counts, optimizer=kind)
    assert plan.parts[f"{kind} state"] == real
    assert plan.parts["lora+grads"] == 8 * sum(p.numel() for p in params)


def test_plan_command_plans_the_configured_optimizer(tmp_path):
    from pipeline.cli import app

    lines = {}
    for kind in ("adamw", "adamw8bit"):
        result = CliRunner().invoke(app, ["plan", "--model", "Qwen/Qwen-Image-Edit-2509", "--set",
                                          f"train.optimizer={kind}"])
        assert result.exit_code == 0, result.output
        lines[kind] = next(line for line in result.output.splitlines() if line.strip().startswith("train "))
    shapes = mp.lora_shapes(mp.transformer_counts("Qwen/Qwen-Image-Edit-2509"), 16)
    for kind, line in lines.items():
        assert f"{kind} state {mp.gib(mp.optimizer_state_bytes(kind, shapes))}" in line, line
    assert mp.optimizer_state_bytes("adamw8bit", shapes) < mp.optimizer_state_bytes("adamw", shapes) / 3.9
