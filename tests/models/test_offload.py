"""Block offload (models/offload.py) on the CPU (always_copy: every onload a real copy): which block is
copied ahead when. Forward: the next block up; a checkpointed backward's recomputes: the next block down; and
the first block of a forward that follows a backward prefetches upwards too (it prefetched downwards, into
nothing, before: the block after it was then copied on the compute stream, unhidden); and the backward's end
copies the first offloaded block ahead for the next forward."""

from __future__ import annotations

import pytest
import torch

from models.offload import offload_blocks
from test_multires import MIXED, SIGMAS, batch_of, make_samples, make_transformer


def _train_step(model, batch):
    from models.multires import multires_forward

    out = multires_forward(model, batch, SIGMAS)
    out.square().mean().backward()


def test_prefetch_follows_the_direction_of_execution():
    from diffusers import QwenImageTransformer2DModel

    from models.multires import install_multires

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=4,
                                        attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                                        axes_dims_rope=(8, 12, 12))
    install_multires(model)
    model.requires_grad_(False)
    model.img_in.weight.requires_grad_(True)  # something to differentiate through every block
    model.enable_gradient_checkpointing()
    model.train()
    off = offload_blocks(model, "cpu", keep=1)  # block 0 stays; 1..3 offloaded
    batch = batch_of(make_samples(MIXED))

    _train_step(model, batch)
    first = list(off.ahead)
    # forward 1, 2, 3 (each fetches the next one up; the last one itself again, for the backward's first
    # recompute), then the backward recomputes 3, 2, 1 (the next one down)
    assert first == [(1, 2), (2, 3), (3, 3), (3, 2), (2, 1), (1, None)]
    assert off.unhidden == 1 and list(off.pending) == [1]  # the backward's end copies block 1 ahead
    off.ahead.clear()
    _train_step(model, batch)
    assert off.unhidden == 1, "the second forward's first block must have been copied ahead, not waited for"
    assert list(off.ahead)[0] == (1, 2), "a forward after a backward must prefetch the next block up"
    assert list(off.ahead) == first


def test_offloaded_training_step_equals_resident():
    """The offloaded model computes the same gradients as the same model resident (the copies are exact)."""
    import copy

    base = make_transformer("axes8-12-12_2x32")
    from models.multires import install_multires

    install_multires(base)
    base.requires_grad_(False)
    base.img_in.weight.requires_grad_(True)
    base.enable_gradient_checkpointing()
    base.train()
    resident = copy.deepcopy(base)
    offload_blocks(base, "cpu", keep=0)
    batch = batch_of(make_samples(MIXED))
    for m in (base, resident):
        _train_step(m, batch)
    assert torch.equal(base.img_in.weight.grad, resident.img_in.weight.grad)


def test_quantized_weights_are_pinned_through_their_inner_tensors():
    """torchao's int8 / fp8 tensors have no pin op of their own: `pinned` pins their codes and scales and
    rebuilds the same tensor (the CPU cannot pin: a clone stands in for pin_memory, and is seen to be called
    on the inner tensors, never on the wrapper)."""
    from models.offload import pinned
    from models.quantize import dequantize, quantize_rows

    w = torch.randn(64, 96, dtype=torch.bfloat16)
    seen = []

    def fake_pin(x):
        seen.append(type(x))
        return x.clone()

    for kind in ("int8", "fp8"):
        seen.clear()
        q = quantize_rows(w, kind)
        p = pinned(q, pin=fake_pin)
        assert type(p) is type(q) and p.shape == q.shape
        assert seen and all(t is torch.Tensor for t in seen)
        assert torch.equal(dequantize(p), dequantize(q))
    seen.clear()
    assert torch.equal(pinned(w, pin=fake_pin), w) and seen == [torch.Tensor]


def test_nf4_base_offloaded_equals_resident(tiny_edit_model):
    """train.quantize_base nf4 + train.offload blocks: the offloaded NF4 weights keep their statistics (a plain
    Parameter around `p.detach()` kept only the packed codes: every forward raised AttributeError) and give the
    resident model's output and gradients bit for bit (CPU: every onload a real copy)."""
    from models.loading import load_component
    from models.multires import install_multires, multires_forward
    from models.quantize import install_frozen_linear_backward, is_nf4

    pytest.importorskip("bitsandbytes")

    def build(offload: bool):
        model = load_component(tiny_edit_model, "transformer", dtype=torch.float32, device="cpu", quantize="nf4")
        install_multires(model)
        model.requires_grad_(False)
        install_frozen_linear_backward(model)
        model.img_in.weight.requires_grad_(True)  # a gradient through every block
        model.enable_gradient_checkpointing()
        model.train()
        if offload:
            offload_blocks(model, "cpu", keep=1)
        return model

    batch = batch_of(make_samples(MIXED))
    results = []
    for offload in (False, True):
        model = build(offload)
        out = multires_forward(model, batch, SIGMAS)
        out.square().mean().backward()
        results.append((out.detach(), model.img_in.weight.grad))
        weights = [m.weight for m in model.transformer_blocks[1].modules() if isinstance(m, torch.nn.Linear)]
        assert weights and all(is_nf4(w) for w in weights)  # the host weights put back after the step
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_nf4_weights_are_pinned_with_their_statistics():
    """A pinned NF4 weight is a new Params4bit with its own pinned codes, absmax and code table: the host
    weight's QuantState is not shared (bitsandbytes' own `.to` moves a shared QuantState in place)."""
    pytest.importorskip("bitsandbytes")
    from models.offload import pinned
    from models.quantize import dequantize, is_nf4, quantize_rows_nf4

    q = quantize_rows_nf4(torch.randn(64, 96, dtype=torch.bfloat16))
    seen = []

    def fake_pin(x):
        seen.append(type(x))
        return x.clone()

    p = pinned(q, pin=fake_pin)
    assert is_nf4(p) and len(seen) == 3 and all(t is torch.Tensor for t in seen)
    assert p.quant_state is not q.quant_state and p.quant_state.absmax is not q.quant_state.absmax
    assert torch.equal(dequantize(p), dequantize(q))


@pytest.fixture
def young_heap_only():
    """The test's gc.collect() calls walk only the objects made after its start (the Parameters it watches are all
    made later): over the worker's whole heap (torch, diffusers, the earlier tests' objects) each of its ten took
    ~1 s, 96% of the test (2026-12-04). A frozen object holding a watched Parameter still holds it: never missed."""
    import gc

    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.parametrize("kind", ["none", "int8"])
def test_one_block_at_a_time_is_on_the_device(kind, young_heap_only):
    """What offload's memory plan counts on: in a checkpointed forward and backward, when a block's device
    weights are installed no other block's are still alive, and after the step none is (the last block
    recomputed is put back when the backward ends). Watched with weak references to the Parameters installed in the
    modules, so whatever holds them (a module, autograd) keeps them counted. The recompute stops early
    (torch.utils.checkpoint's default) and never ran the block's forward hook: every block's weights stayed
    installed until the next step, and on the H200 int8 + offload ran out of memory at a 24 GiB cap with
    22.7 GiB allocated where 10.3 were planned (2026-12-04)."""
    import gc
    import weakref

    from models.checkpointing import enable_checkpointing
    from models.multires import install_multires
    from models.quantize import install_frozen_linear_backward, quantize_rows, quantized_weight_names

    model = make_transformer("axes8-12-12_2x32")
    install_multires(model)
    model.requires_grad_(False)
    if kind != "none":
        for name in quantized_weight_names(model):
            owner, _, pname = name.rpartition(".")
            mod = model.get_submodule(owner)
            mod._parameters[pname] = torch.nn.Parameter(quantize_rows(mod.weight.detach(), kind), requires_grad=False)
        install_frozen_linear_backward(model)
    model.img_in.weight.requires_grad_(True)  # a gradient through every block
    enable_checkpointing(model)
    model.train()
    off = offload_blocks(model, "cpu", keep=0)
    installed, alive_at_onload = [], []

    def watch(i):
        def hook(module, args):  # registered after the offloader's: its weights are installed now
            mod, name, _ = off.blocks[i].slots[0]
            installed.append((i, weakref.ref(mod._parameters[name])))
            gc.collect()
            alive_at_onload.append((i, sorted({j for j, r in installed if r() is not None})))
        return hook

    blocks = model.transformer_blocks
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(watch(i))
    _train_step(model, batch_of(make_samples(MIXED)))
    gc.collect()
    n = len(blocks)
    # forward 0..n-1, then the backward's recomputes n-1..0: each alone on the device
    assert alive_at_onload == [(i, [i]) for i in [*range(n), *reversed(range(n))]]
    assert sorted({j for j, r in installed if r() is not None}) == []  # block 0 too: nothing between steps
    assert off.most_live == 1 and not off.live and not off.installed  # the offloader's own count agrees
    _train_step(model, batch_of(make_samples(MIXED)))
    gc.collect()
    assert sorted({j for j, r in installed if r() is not None}) == [] and off.most_live == 1
