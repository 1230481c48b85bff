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
        ddp = wrap(transformer, 2)
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


def _saved_bytes(model, loss_of) -> int:
    """Bytes of the tensors autograd keeps for the backward of one step's forward (bf16 autocast, as the plan's
    constants were counted), the frozen weights left out: a checkpointed block's saved inputs included."""
    weights = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved = {}

    def pack(t):
        if t.data_ptr() not in weights:
            saved[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        loss_of(model)
    return sum(saved.values())


def test_planned_uncheckpointed_blocks_keep_what_a_block_saves(tiny_edit_model):
    """train.uncheckpointed_blocks: each leading block left out of checkpointing adds (per_token_block -
    checkpointed, the family's ActivationUnits) x tokens x width to the plan; measured on the tiny Edit model through the trainer's setup,
    each adds what a block saves beyond its checkpointed input: 18.9 width-elements per token here vs the plan's
    20 (Edit's 21 was counted on a full-width block), and all of them left out keep what no
    checkpointing keeps. A selection ignored (every block checkpointed) measures nothing added."""
    from test_partial_checkpointing import _edit_loss, _model

    bf16 = {"train.dtype": "bfloat16", "train.mixed_precision": "bf16"}

    def measured(overrides):
        return _saved_bytes(_model(tiny_edit_model, {**bf16, **overrides}), _edit_loss)

    none = measured({"train.gradient_checkpointing": False})
    kept = [measured({"train.gradient_checkpointing": True, "train.uncheckpointed_blocks": n}) for n in (0, 1, 2)]
    assert kept[2] == none  # both blocks left out: what no checkpointing saves

    counts = mp.counts_from_model(_model(tiny_edit_model, {}))
    tokens = 4 * 6 + 7  # _edit_loss's image and text tokens

    def planned(n, checkpointing=True):
        return mp.train_plan("", "bfloat16", "none", 1, tokens, checkpointing, 4, counts=counts,
                             uncheckpointed_blocks=n).parts["activations"]

    per_block = planned(1) - planned(0)
    units = counts.activations
    assert per_block == (units.per_token_block - units.checkpointed) * tokens * counts.width * 2
    assert [planned(n) for n in (0, 1, 2)] == [planned(0) + n * per_block for n in (0, 1)] + [planned(2, False)]
    measured_per_block = (kept[2] - kept[0]) / counts.blocks
    print(f"planned / measured per kept block: {per_block / measured_per_block:.3f}")
    assert 0.9 < per_block / measured_per_block < 1.1, (per_block, measured_per_block)


def test_plan_command_prints_the_largest_uncheckpointed_count_that_fits():
    """`pipeline plan --gpu-memory G`: the largest train.uncheckpointed_blocks whose training plan fits G, one
    line; offload caps it at the blocks kept on the device; a card that holds every block's activations says
    checkpointing is not needed."""
    from pipeline.cli import app

    hub = "Qwen/Qwen-Image-Edit-2509"

    def plan(*args):
        result = CliRunner().invoke(app, ["plan", "--model", hub, "--set", "train.batch_size=1", *args])
        return result.output

    out = plan("--gpu-memory", "80")
    line = next(line for line in out.splitlines() if "train.uncheckpointed_blocks" in line)
    n = int(line.split("train.uncheckpointed_blocks ")[1].split()[0])
    tokens = int(out.split(" tokens per training sample")[0].split()[-1])
    total = lambda k: mp.train_plan(hub, "bfloat16", "none", 1, tokens, True, 16, uncheckpointed_blocks=k).total  # noqa: E731
    assert 0 < n < 60 and total(n) <= 80 * 2**30 < total(n + 1), line
    assert f"train.gradient_checkpointing true, train.uncheckpointed_blocks {n}" in line
    offloaded = plan("--gpu-memory", "80", "--set", "train.offload=blocks", "--set", "train.offload_blocks_on_device=5")
    assert "train.uncheckpointed_blocks 5 (5 of 60 blocks" in offloaded and "at most train.offload_blocks_on_device" in offloaded
    assert "not needed" in plan("--gpu-memory", "1000")
    # offload checkpoints its blocks whatever gradient_checkpointing says: "not needed" would change nothing
    all_kept = plan("--gpu-memory", "1000", "--set", "train.offload=blocks", "--set", "train.offload_blocks_on_device=60")
    assert "train.uncheckpointed_blocks 60 (every block" in all_kept and "not needed" not in all_kept, all_kept
    assert "uncheckpointed_blocks" not in plan("--gpu-memory", "20")  # not even every block checkpointed fits
    assert "uncheckpointed_blocks" not in plan()  # no card given
