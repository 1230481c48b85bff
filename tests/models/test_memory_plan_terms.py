"""`pipeline plan`'s train terms for what training holds besides the step itself, each equal to the real tensors on
the tiny model: DDP's gradient buckets (several processes), the float32 VAE the validator loads for its sample
grids, the EMA's shadow of the adapter. None of them was planned: an 8-process run with sample grids could pass
`plan` and run out of memory."""

from __future__ import annotations

import socket

import pytest
import torch
from typer.testing import CliRunner

from models import memory_plan as mp
from schemas.config import LoraConfig


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def lora_transformer(model: str):
    from models.loading import load_component
    from models.lora import add_lora

    transformer = load_component(model, "transformer", dtype=torch.float32)
    counts = mp.counts_from_model(transformer)
    transformer.requires_grad_(False)
    add_lora(transformer, LoraConfig(rank=4))
    return transformer, counts


def train_part(counts, name: str, **kw) -> int | None:
    return mp.train_plan("", "float32", "none", 1, 64, False, 4, counts=counts, **kw).parts.get(name)


def test_planned_ddp_buckets_are_the_buckets_ddp_all_reduces(tiny_edit_model):
    """The trainer's DDP wrap (stages/train/parallel.py) on a one-process gloo group: the flat buckets DDP hands
    its comm hook in a backward, separate storage from the .grad tensors (so they come on top), are the plan's."""
    import torch.distributed as dist

    from models.lora import lora_parameters
    from stages.train.parallel import wrap

    transformer, counts = lora_transformer(tiny_edit_model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        ddp = wrap(transformer, 2, LoraConfig(rank=4).target_modules)
        buckets = []

        def keep(state, bucket):
            buckets.append(bucket.buffer())
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

        ddp.register_comm_hook(None, keep)
        cfg, h, w, text = transformer.config, 4, 4, 6
        out = ddp(hidden_states=torch.randn(1, h * w, cfg.in_channels), timestep=torch.tensor([0.5]),
                  encoder_hidden_states=torch.randn(1, text, cfg.joint_attention_dim),
                  encoder_hidden_states_mask=torch.ones(1, text), img_shapes=[[(1, h, w)]], return_dict=False)[0]
        out.square().mean().backward()
    finally:
        dist.destroy_process_group()
    grads = [p.grad for p in lora_parameters(transformer)]
    assert all(g is not None for g in grads)
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buckets]
    assert not any(lo <= g.data_ptr() < hi for g in grads for lo, hi in spans), "gradients are views of the buckets"
    assert train_part(counts, "DDP gradient buckets", processes=2) == nbytes(buckets) > 0
    assert train_part(counts, "DDP gradient buckets", processes=1) is None


@pytest.mark.parametrize("fixture", ["tiny_edit_model", "tiny_21_model"])
def test_planned_validation_vae_is_the_vae_the_validator_loads(fixture, request):
    """Validator.samples_grid's load (float32, kept for the run), measured: parameters and buffers."""
    from models.loading import load_component

    model = request.getfixturevalue(fixture)
    vae = load_component(model, "vae", dtype=torch.float32)
    real = nbytes(vae.parameters()) + nbytes(vae.buffers())
    plan = mp.train_plan(model, "float32", "none", 1, 64, False, 4, sample_vae=True)
    assert plan.parts["validation VAE (float32)"] == real
    assert "validation VAE (float32)" not in mp.train_plan(model, "float32", "none", 1, 64, False, 4).parts


def test_planned_ema_is_the_shadow_the_ema_holds(tiny_edit_model):
    from models.lora import lora_parameters
    from stages.train.ema import AdapterEMA

    transformer, counts = lora_transformer(tiny_edit_model)
    ema = AdapterEMA(lora_parameters(transformer), 0.99)
    assert train_part(counts, "EMA", ema=True) == nbytes(ema.shadow) > 0
    assert train_part(counts, "EMA") is None


def test_plan_command_counts_processes_sample_grids_and_ema():
    from pipeline.cli import app

    def train_line(*args):
        result = CliRunner().invoke(app, ["plan", "--model", "Qwen/Qwen-Image-Edit-2509", *args])
        assert result.exit_code == 0, result.output
        return next(line for line in result.output.splitlines() if line.strip().startswith("train "))

    assert "DDP" not in train_line() and "VAE" not in train_line() and "EMA" not in train_line()
    adapter = mp.lora_params(mp.transformer_counts("Qwen/Qwen-Image-Edit-2509"), 16)
    assert f"DDP gradient buckets {mp.gib(4 * adapter)}" in train_line("--processes", "8")
    vae = mp.component_params("Qwen/Qwen-Image-Edit-2509", "vae")
    assert f"validation VAE (float32) {mp.gib(4 * vae)}" in train_line("--set", "train.sample_every=100")
    assert f"EMA {mp.gib(4 * adapter)}" in train_line("--set", "train.ema_decay=0.999")
