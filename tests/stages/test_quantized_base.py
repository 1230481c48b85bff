"""Quantised frozen base (train.quantize_base int8 / fp8): quantised while loading, trains, and the LoRA it
gives is a plain diffusers LoRA that loads onto the unquantised base (stock `load_lora_weights`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.loading import load_component
from models.lora import read_lora
from models.quantize import is_quantized
from pipeline.config import load_config
from stages.train.recipe import run
from train_store import make_train_store, mixed_specs


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_edit_model):
    root = tmp_path_factory.mktemp("qtrain") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    return root


@pytest.mark.parametrize("quantize", ["int8", "fp8"])
def test_quantized_while_loading_blocks_only(quantize, tiny_edit_model, monkeypatch):
    import torchao.quantization as tq
    from diffusers import QwenImageTransformer2DModel

    from models import quantize as qmod
    from models.quantize import quantization_config

    # Quantised a few rows at a time as each weight is read: never a whole model, never a whole weight.
    calls, original = [], tq.quantize_
    monkeypatch.setattr(tq, "quantize_", lambda module, *a, **k: calls.append(module.weight.shape) or original(module, *a, **k))
    monkeypatch.setattr(qmod, "ROWS", 16)
    tr = load_component(tiny_edit_model, "transformer", dtype=torch.bfloat16, device="cpu", quantize=quantize)
    assert calls and all(shape[0] <= 16 for shape in calls) and any(shape[0] == 16 for shape in calls)
    assert is_quantized(tr.transformer_blocks[0].attn.to_q.weight)
    assert is_quantized(tr.transformer_blocks[0].img_mlp.net[2].weight)
    assert not is_quantized(tr.img_in.weight) and not is_quantized(tr.proj_out.weight)  # in/out stay exact

    # the same weights as diffusers' own quantise-while-loading path (TorchAoConfig), the upstream reference
    ref = QwenImageTransformer2DModel.from_pretrained(Path(tiny_edit_model) / "transformer", torch_dtype=torch.bfloat16,
                                                      quantization_config=quantization_config(quantize))
    ours = dict(tr.named_parameters())
    for name, p in ref.named_parameters():
        a, b = ours[name], p
        if is_quantized(b):
            assert type(a) is type(b), name
            a, b = a.dequantize(), b.dequantize()
        assert torch.equal(a, b), name


def test_quantize_rows_joins_chunks_exactly():
    from models.quantize import quantize_rows, torchao_config
    from torchao.quantization import quantize_

    w = torch.randn(100, 48, dtype=torch.bfloat16)
    for name in ("int8", "fp8"):
        whole = torch.nn.Linear(48, 100, bias=False, dtype=torch.bfloat16)
        whole.weight.data = w.clone()
        quantize_(whole, torchao_config(name))
        chunked = quantize_rows(w, name, rows=32)
        assert type(chunked) is type(whole.weight) and chunked.shape == w.shape
        assert torch.equal(chunked.dequantize(), whole.weight.dequantize())


@pytest.mark.parametrize("quantize", ["int8", "fp8"])
def test_lora_from_a_quantized_base_loads_on_the_plain_base(quantize, store_dir, tiny_edit_model, tmp_path):
    from diffusers import QwenImageEditPipeline

    cfg = load_config(None, {"train.device": "cpu", "train.max_steps": 2, "train.batch_size": 2,
                             "train.learning_rate": 2e-3, "train.lora.rank": 4, "train.quantize_base": quantize})
    result = run(cfg, store_dir, tiny_edit_model, tmp_path / quantize)
    assert all(torch.isfinite(torch.tensor(result.losses)))
    saved, _ = read_lora(result.lora_dir)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # it trained

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model)  # plain float32 base, stock loader
    pipe.load_lora_weights(result.lora_dir)
    assert not is_quantized(pipe.transformer.transformer_blocks[0].attn.to_q.base_layer.weight)
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if ".lora_" in n}
    for key, value in saved.items():
        name = key.removeprefix("transformer.").replace(".weight", ".default_0.weight")
        assert torch.equal(loaded[name].detach(), value), key


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_offloaded_blocks_train_the_same_lora(quantize, store_dir, tiny_edit_model, tmp_path):
    """offload=blocks (storage and compute on the CPU, every onload a real copy) = no offload, bit for bit."""
    from models.offload import BlockOffloader

    base = {"train.device": "cpu", "train.max_steps": 2, "train.batch_size": 2, "train.learning_rate": 2e-3,
            "train.lora.rank": 4, "train.gradient_checkpointing": True, "train.quantize_base": quantize}
    plain = run(load_config(None, base), store_dir, tiny_edit_model, tmp_path / "plain")
    seen = []
    original = BlockOffloader.__init__

    def spy(self, *a, **k):
        original(self, *a, **k)
        seen.append(self)

    import unittest.mock as um

    with um.patch.object(BlockOffloader, "__init__", spy):
        off = run(load_config(None, {**base, "train.offload": "blocks", "train.offload_blocks_on_device": 1,
                                     "train.gradient_checkpointing": False}),
                  store_dir, tiny_edit_model, tmp_path / "off")
    (offloader,) = seen
    assert offloader.always_copy and list(offloader.blocks) == [1]  # block 0 resident, block 1 streamed
    # forward + recompute per micro-batch and step
    assert offloader.onloads >= 2 * 2
    a, b = read_lora(plain.lora_dir)[0], read_lora(off.lora_dir)[0]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert plain.losses == off.losses


@pytest.mark.parametrize("quantize", ["int8", "fp8"])
def test_quantized_backward_keeps_no_dense_copy(quantize, tiny_edit_model):
    """The input gradient through a frozen quantised linear equals the dense-dequantised reference, and
    autograd saves only the quantised weight (not a dense copy of it)."""
    from models.quantize import install_frozen_linear_backward

    tr = load_component(tiny_edit_model, "transformer", dtype=torch.bfloat16, device="cpu", quantize=quantize)
    lin = tr.transformer_blocks[0].img_mlp.net[2]
    dense = lin.weight.dequantize().float()
    x = torch.randn(5, lin.in_features, requires_grad=True)
    (torch.nn.functional.linear(x, dense, lin.bias.float()) ** 2).sum().backward()
    ref = x.grad.clone()

    assert install_frozen_linear_backward(tr) > 0
    x.grad = None
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = lin(x)
    (y.float() ** 2).sum().backward()
    assert [type(t).__name__ for t in saved] == [type(lin.weight).__name__]
    torch.testing.assert_close(x.grad, ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
