"""The attention layout of a padded batch is built once per forward, outside the blocks (models/attention.py
`JointLayout`): no host sync inside a block, one layout for all blocks and their checkpoint recomputes, and
regional compile + gradient checkpointing (the default GPU configuration) training the same LoRA as eager.

On the H200 (bench/gpu/results/h200.json) compile + checkpointing raised torch.utils.checkpoint's
"Recomputed values ... have different metadata": block 0 built the layout (a host sync, a graph break under
Dynamo) and cached it, so its forward and its recompute ran different graphs that saved different tensors."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from peft import LoraConfig
from torch.utils._python_dispatch import TorchDispatchMode

from models import attention
from models.attention import set_backend
from models.multires import install_multires, multires_forward, target_outputs
from test_multires import C, MIXED, SIGMAS, TXT_DIM, batch_of, make_samples, rel_err

# Ops that wait for the device (a tensor's value read on the host, or an output size that depends on values).
SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
            torch.ops.aten.masked_select.default, torch.ops.aten.item.default}


def lora_model(layers: int = 2, backend: str = "packed") -> QwenImageTransformer2DModel:
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=4 * C, out_channels=C, num_layers=layers,
                                        attention_head_dim=32, joint_attention_dim=TXT_DIM, num_attention_heads=2,
                                        axes_dims_rope=(8, 12, 12), zero_cond_t=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    install_multires(model)
    model.requires_grad_(False)
    torch.manual_seed(7)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                 init_lora_weights=False))
    set_backend(model, backend)
    model.train()
    model.enable_gradient_checkpointing()
    return model


def lora_grads(model, samples) -> tuple[float, list[torch.Tensor]]:
    batch = batch_of(samples)
    targets = [torch.randn_like(s["target"], generator=torch.Generator().manual_seed(3)) for s in samples]
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    out = multires_forward(model, batch, SIGMAS[: len(samples)])
    loss = sum(((o - t) ** 2).mean() for o, t in zip(target_outputs(out, batch), targets))
    return loss.item(), list(torch.autograd.grad(loss, params))


class InBlockSyncs(TorchDispatchMode):
    """Counts sync ops run while a transformer block executes (forward and checkpoint recompute)."""

    def __init__(self, model):
        super().__init__()
        self.depth, self.count, self.outside = 0, Counter(), Counter()
        for block in model.transformer_blocks:
            block.register_forward_pre_hook(lambda *a: setattr(self, "depth", self.depth + 1))
            block.register_forward_hook(lambda *a: setattr(self, "depth", self.depth - 1))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS:
            (self.count if self.depth else self.outside)[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_packed_layout_built_once_per_forward_and_no_sync_inside_blocks(monkeypatch):
    """A training step (checkpointing on) builds the packed layout once, nothing inside a block waits for the
    device, and the step's syncs do not grow with depth (2 vs 4 blocks)."""
    real = attention.packed_layout
    outside = {}
    for layers in (2, 4):
        model = lora_model(layers)
        built = []
        monkeypatch.setattr(attention, "packed_layout", lambda mask: built.append(mask.shape) or real(mask))
        counter = InBlockSyncs(model)
        with counter:
            _, grads = lora_grads(model, make_samples(MIXED))
        assert len(built) == 1  # one layout for all blocks, their recomputes included
        assert not counter.count, f"host syncs inside the blocks: {dict(counter.count)}"
        assert all(g.abs().max() > 0 for g in grads)
        outside[layers] = counter.outside
    assert outside[2] == outside[4] and sum(outside[2].values()) <= 6, outside


@pytest.mark.parametrize("backend", ["packed", "native"])
def test_compiled_checkpointed_lora_gradients_equal_eager(backend):
    """Regional compile (fullgraph: a graph break is an error) with gradient checkpointing, two batches of
    different shapes (dynamic): loss and LoRA gradients equal eager's within 1e-5 (float32; aot_eager runs
    the same aten ops, so the difference is summation order only). Inductor on this CPU would take minutes;
    tests/gpu covers it on CUDA."""
    torch._dynamo.reset()
    eager = lora_model(2, backend)
    compiled = copy.deepcopy(eager)
    compiled.compile_repeated_blocks(dynamic=True, fullgraph=True, backend="aot_eager")
    for spec in (MIXED, MIXED[:3] + MIXED[4:] + MIXED[1:2]):  # the second: other lengths (the 8x8 target out)
        samples = make_samples(spec)
        ref_loss, ref = lora_grads(eager, samples)
        loss, got = lora_grads(compiled, samples)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
        assert max(rel_err(g, r) for g, r in zip(got, ref)) <= 1e-5
