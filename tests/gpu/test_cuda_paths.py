"""CUDA-only paths at a small width (seconds each on a GPU): the padded batch vs each sample alone on CUDA's
attention kernels, offload's side stream and pinned host weights, the pinned prefetch thread, compile +
packed, device_map loading. Skipped without CUDA (conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from bench.gpu.correctness import (BF16_FLOOR_FACTOR, BF16_MIN_TOL, FP32_TOL, batched, compare, compare_stock,
                                   make_model, make_samples, stock_reference)

SMALL = dict(heads=4, head_dim=64, axes=(16, 24, 24), joint=64, layers=2, channels=4)


def _setup(dtype, device):
    samples = make_samples(SMALL, smoke=True)
    g = torch.Generator().manual_seed(7)
    sigmas = torch.tensor([0.5, 0.25, 0.75])
    weights = [torch.randn(s["target"].shape[0] + sum(c.shape[-1] * c.shape[-2] // 4 for c in s["controls"]),
                           4 * SMALL["channels"], generator=g) for s in samples]
    stock = make_model(SMALL, torch.float32, device)
    return samples, sigmas, weights, stock


@pytest.mark.parametrize("backend,dtype", [
    ("native", torch.float32), ("_native_efficient", torch.float32), ("_native_math", torch.float32),
    ("packed", torch.bfloat16), ("native", torch.bfloat16), ("_native_cudnn", torch.bfloat16),
])
def test_padded_batch_equals_each_sample_alone_on_cuda(cuda, backend, dtype):
    """fp32 (TF32 off) within 1e-4 of the stock model run per sample; bf16 within twice the stock model's own
    bf16 error (each sample alone, bf16 vs fp32), as bench/gpu/correctness.py judges it."""
    from models.multires import install_multires

    samples, sigmas, weights, stock = _setup(dtype, cuda)
    ref = stock_reference(stock, samples, sigmas, weights, cuda)
    if dtype is torch.bfloat16:
        floor = compare_stock(stock_reference(copy.deepcopy(stock).to(dtype), samples, sigmas, weights, cuda), ref)
        tol = {k: max(BF16_MIN_TOL, BF16_FLOOR_FACTOR * v) for k, v in floor.items()}
    else:
        tol = dict.fromkeys(("forward", "grad_input_image", "grad_input_text", "grad_weights"), FP32_TOL)
    multi = copy.deepcopy(stock).to(dtype)
    install_multires(multi)
    errs = compare(batched(multi, samples, sigmas, weights, cuda, backend), ref)
    assert errs["padded_out_exact_zero"] and errs["padded_grad_image_exact_zero"] and errs["padded_grad_text_exact_zero"]
    assert not errs["missing_weight_grads"]
    for key, limit in tol.items():
        assert errs[key] <= limit, (key, errs, tol)


def test_packed_probe_passes_on_this_gpu(cuda):
    from models.attention import choose

    c = choose(None, cuda, torch.bfloat16)
    assert c.backend == "packed", c.reason


def _offload_model(device):
    from models.attention import set_backend
    from models.multires import install_multires

    model = make_model(SMALL, torch.bfloat16, device)
    install_multires(model)
    set_backend(model, "_native_math")  # a deterministic backward: offload must change no bit
    model.requires_grad_(False)
    model.img_in.weight.requires_grad_(True)
    model.enable_gradient_checkpointing()
    return model.train()


def test_offload_streams_pinned_weights_same_gradients(cuda):
    from models.multires import build_batch, multires_forward
    from models.offload import offload_blocks

    resident = _offload_model(cuda)
    off_model = copy.deepcopy(resident)
    off = offload_blocks(off_model, cuda, keep=0)
    assert off.stream is not None
    host = [hp for b in off.blocks.values() for _, _, hp in b.slots]
    assert host and all(p.is_pinned() and p.device.type == "cpu" for p in host)
    samples = make_samples(SMALL, smoke=True)
    batch = build_batch([s["target"] for s in samples], [s["controls"] for s in samples],
                        [s["prompt"] for s in samples], [s["shapes"] for s in samples]).to(cuda, torch.bfloat16)
    sig = torch.tensor([0.5, 0.25, 0.75], device=cuda, dtype=torch.bfloat16)
    for _ in range(2):  # the second step: the forward after a backward
        off.ahead.clear()
        for m in (resident, off_model):
            m.img_in.weight.grad = None
            multires_forward(m, batch, sig).float().square().mean().backward()
        torch.cuda.synchronize()
        assert torch.equal(resident.img_in.weight.grad, off_model.img_in.weight.grad)
    assert list(off.ahead)[0] == (0, 1)  # the forward after a backward: block 0 copied block 1 ahead
    assert off.unhidden == 1  # only the very first onload was waited for (the backward's end copies block 0)


def test_compile_with_packed_matches_eager(cuda):
    from models.attention import set_backend

    samples, sigmas, weights, stock = _setup(torch.bfloat16, cuda)
    from models.multires import install_multires

    eager = copy.deepcopy(stock).to(torch.bfloat16)
    install_multires(eager)
    compiled = copy.deepcopy(eager)
    set_backend(compiled, "packed")
    compiled.compile_repeated_blocks(dynamic=True)
    a = batched(eager, samples, sigmas, weights, cuda, "packed")
    b = batched(compiled, samples, sigmas, weights, cuda, "packed")
    assert (a["out"] - b["out"]).abs().max() <= 3e-2 * a["out"].abs().max()
    assert torch.equal(b["out"][~b["image_mask"]], torch.zeros_like(b["out"][~b["image_mask"]]))


def test_compile_packed_checkpointing_lora_gradients_match_eager(cuda):
    """The default GPU training configuration: bf16, `packed`, regional compile (inductor, fullgraph: a graph
    break fails), gradient checkpointing, a LoRA. On the H200 this raised checkpoint's "Recomputed values ...
    different metadata" (the layout built inside block 0). Two batches of different shapes; the LoRA
    gradients within 5e-2 of eager's (bf16: inductor fuses and rounds differently)."""
    from peft import LoraConfig

    from models.multires import install_multires

    samples, sigmas, weights, stock = _setup(torch.bfloat16, cuda)
    eager = copy.deepcopy(stock).to(torch.bfloat16)
    install_multires(eager)
    eager.requires_grad_(False)
    torch.manual_seed(7)
    eager.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                 init_lora_weights=False))
    eager.enable_gradient_checkpointing()
    eager.train()
    compiled = copy.deepcopy(eager)
    compiled.compile_repeated_blocks(dynamic=True, fullgraph=True)
    for n in (3, 2):
        a = batched(eager, samples[:n], sigmas[:n], weights[:n], cuda, "packed")
        b = batched(compiled, samples[:n], sigmas[:n], weights[:n], cuda, "packed")
        lora = [k for k in a["grad_w"] if "lora_" in k]
        assert lora and lora == [k for k in b["grad_w"] if "lora_" in k]
        errs = {k: compare_grads(b["grad_w"][k], a["grad_w"][k]) for k in lora}
        assert max(errs.values()) <= 5e-2, errs
        assert torch.equal(b["out"][~b["image_mask"]], torch.zeros_like(b["out"][~b["image_mask"]]))


def compare_grads(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def test_auto_dtype_is_bf16_on_this_gpu(cuda):
    from models.precision import resolve_dtype

    assert resolve_dtype("auto", cuda) is torch.bfloat16


def test_device_map_loading_lands_on_the_gpu(cuda, tiny_edit_model):
    from models.loading import load_component

    for component in ("transformer", "vae", "text_encoder"):
        m = load_component(tiny_edit_model, component, dtype=torch.bfloat16, device="cuda:0")
        assert {p.device for p in m.parameters()} == {torch.device("cuda", 0)}, component


def test_pinned_prefetch_thread_and_offload_train_the_same_lora(cuda, tmp_path):
    from bench.gpu.same_lora import run_same_lora

    class Rec(dict):
        def flush(self):
            pass

    rec = Rec()
    import time

    run_same_lora(cuda, smoke=True, work=tmp_path, deadline=time.monotonic() + 600, record=rec)
    same = rec["same_lora"]
    for name in ("offload", "prefetch"):
        assert same[name]["ran"], same[name]
        assert same[name]["ok"], same[name]
