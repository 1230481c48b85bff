"""The chunked quantised linear on CUDA: its input gradient goes through the tensor cores with float32
accumulation (models/quantize._accumulate) and keeps the dense bf16 error."""

from __future__ import annotations

import pytest
import torch


def test_quantized_input_gradient_on_cuda_has_the_dense_bf16_error(cuda, monkeypatch):
    from models import quantize as qmod

    torch.manual_seed(0)
    monkeypatch.setattr(qmod, "DEQUANT_ELEMENTS", 64 * 1024)  # 64-row chunks: 32 chunks of a 2048 x 1024 weight
    lin = torch.nn.Linear(1024, 2048, bias=False, dtype=torch.bfloat16, device=cuda)
    lin.weight = torch.nn.Parameter(qmod.quantize_rows(lin.weight.detach(), "int8"), requires_grad=False)
    assert qmod.install_frozen_linear_backward(lin) == 1 and 2048 // qmod.row_chunk(lin.weight) == 32
    assert qmod._has_out_dtype()  # the tensor-core path, not the float32 fallback
    x = torch.randn(4096, 1024, dtype=torch.bfloat16, device=cuda, requires_grad=True)
    g = torch.randn(4096, 2048, dtype=torch.bfloat16, device=cuda)
    lin(x).backward(g)
    w = qmod.dequantize(lin.weight).to(torch.bfloat16)
    exact = g.double() @ w.double()
    dense_bf16 = g @ w

    def rel(a):
        return ((a.double() - exact).norm() / exact.norm()).item()

    assert rel(x.grad) <= 1.05 * rel(dense_bf16), (rel(x.grad), rel(dense_bf16))


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_offload_of_a_quantized_base_streams_and_matches_resident(cuda, kind):
    """torchao's quantised weights have no record_stream (the H200 run died on it): offload records the stream
    on their inner tensors, and the offloaded int8 model computes the resident one's gradients. nf4: the pinned
    host codes and statistics (each copy its own QuantState) on the side stream, the same gradients."""
    if kind == "nf4":
        pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (bench/gpu/prepare --bitsandbytes)")
    from bench.gpu.correctness import make_samples
    from models import quantize as qmod
    from models.multires import build_batch, multires_forward
    from models.offload import offload_blocks
    from test_cuda_paths import SMALL, _offload_model

    def quantized(weight):
        if kind == "nf4":
            return qmod.quantize_rows_nf4(weight)  # a Params4bit already
        return torch.nn.Parameter(qmod.quantize_rows(weight, kind), requires_grad=False)

    def quantized_model():
        torch.manual_seed(0)
        model = _offload_model(cuda)
        for block in model.transformer_blocks:
            for m in block.modules():
                if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad:
                    m.weight = quantized(m.weight.detach())
        qmod.install_frozen_linear_backward(model)
        return model

    resident, off_model = quantized_model(), quantized_model()
    off = offload_blocks(off_model, cuda, keep=0)
    assert off.stream is not None
    samples = make_samples(SMALL, smoke=True)
    batch = build_batch([s["target"] for s in samples], [s["controls"] for s in samples],
                        [s["prompt"] for s in samples], [s["shapes"] for s in samples]).to(cuda, torch.bfloat16)
    sig = torch.tensor([0.5, 0.25, 0.75], device=cuda, dtype=torch.bfloat16)
    for _ in range(2):
        for m in (resident, off_model):
            m.img_in.weight.grad = None
            multires_forward(m, batch, sig).float().square().mean().backward()
        torch.cuda.synchronize()
        assert torch.equal(resident.img_in.weight.grad, off_model.img_in.weight.grad)
