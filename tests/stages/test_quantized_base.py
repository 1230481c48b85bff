"""Quantised frozen base (train.quantize_base int8 / fp8 / nf4): quantised while loading, trains, and the LoRA
it gives is a plain diffusers LoRA that loads onto the unquantised base (stock `load_lora_weights`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.loading import load_component
from models.lora import read_lora
from models.quantize import dequantize, is_quantized
from pipeline.config import load_config
from stages.train.recipe import run
from train_store import assert_same_training, make_train_store, mixed_specs, offloaders_built


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


def test_nf4_quantized_while_loading_equals_bitsandbytes(tiny_edit_model, monkeypatch):
    """NF4 row chunks as each weight is read; the result is bitsandbytes' own quantisation of the whole weight
    (diffusers' BitsAndBytesConfig loader, the other reference, refuses a machine without a GPU)."""
    import bitsandbytes.functional as bf
    from bitsandbytes.nn import Params4bit

    from models import quantize as qmod

    calls, original = [], bf.quantize_4bit
    monkeypatch.setattr(bf, "quantize_4bit", lambda a, *x, **k: calls.append(a.shape) or original(a, *x, **k))
    monkeypatch.setattr(qmod, "ROWS", 16)
    tr = load_component(tiny_edit_model, "transformer", dtype=torch.bfloat16, device="cpu", quantize="nf4")
    assert calls and all(shape[0] <= 16 for shape in calls) and any(shape[0] == 16 for shape in calls)
    monkeypatch.setattr(bf, "quantize_4bit", original)
    plain = dict(load_component(tiny_edit_model, "transformer", dtype=torch.bfloat16, device="cpu").named_parameters())
    n = 0
    for name, p in tr.named_parameters():
        if name.startswith("transformer_blocks.") and name.endswith(".weight") and p.ndim == 2 and "norm" not in name:
            assert type(p) is Params4bit, name
            packed, state = bf.quantize_4bit(plain[name].data, blocksize=64, quant_type="nf4", compress_statistics=False)
            assert torch.equal(p.data, packed) and torch.equal(p.quant_state.absmax, state.absmax), name
            assert torch.equal(dequantize(p), _nf4_by_hand(packed, state, plain[name].shape)), name
            n += 1
        else:
            assert not is_quantized(p) and torch.equal(p, plain[name]), name
    assert n > 0 and not is_quantized(tr.img_in.weight) and not is_quantized(tr.proj_out.weight)


def _nf4_by_hand(packed, state, shape):
    """NF4 dequantisation from its definition: code[4-bit index] x absmax of the 64-value block (flat order)."""
    b = packed.reshape(-1)
    idx = torch.stack([(b >> 4).long(), (b & 15).long()], 1).reshape(-1)[: shape[0] * shape[1]]
    return (state.code[idx].float() * state.absmax.repeat_interleave(64)[: idx.numel()]).reshape(shape).bfloat16()


def test_nf4_rows_not_on_a_block_boundary():
    """in_features 40: a 64-value block spans rows, so row chunks are rounded to 8 rows (40 x 8 = 5 blocks)."""
    import bitsandbytes.functional as bf

    from models.quantize import dequantize_rows, quantize_rows_nf4

    w = torch.randn(100, 40, dtype=torch.bfloat16)
    packed, state = bf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    ours = quantize_rows_nf4(w, rows=12)
    assert torch.equal(ours.data, packed) and torch.equal(ours.quant_state.absmax, state.absmax)
    whole = _nf4_by_hand(packed, state, (100, 40))
    assert torch.equal(dequantize_rows(ours, 0, 100), whole)
    assert torch.equal(dequantize_rows(ours, 16, 40), whole[16:40]) and torch.equal(dequantize_rows(ours, 96, 104), whole[96:])
    assert (whole.float() - w.float()).abs().mean() < 0.1  # NF4 of randn: ~0.07 mean abs error


def test_nf4_chunked_linear_matches_bitsandbytes_matmul(monkeypatch):
    """Forward and input gradient of the chunked NF4 linear (several chunks) = bitsandbytes' matmul_4bit."""
    import bitsandbytes as bnb

    from models import quantize as qmod

    monkeypatch.setattr(qmod, "DEQUANT_ELEMENTS", 32 * 128)  # 32-row chunks of a 100 x 128 weight
    lin = torch.nn.Linear(128, 100, dtype=torch.bfloat16)
    lin.weight = qmod.quantize_rows_nf4(lin.weight.detach())
    lin.bias.requires_grad_(False)
    assert qmod.row_chunk(lin.weight) == 32 and qmod.install_frozen_linear_backward(lin) == 1
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = lin(a)
    yb = bnb.matmul_4bit(b, lin.weight.t(), lin.weight.quant_state, bias=lin.bias)
    torch.testing.assert_close(ya, yb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(a.grad, b.grad, rtol=0.02, atol=0.02 * b.grad.abs().max().item())


def test_quantize_rows_joins_chunks_exactly():
    from models.quantize import dequantize_rows, quantize_rows, torchao_config
    from torchao.quantization import quantize_

    w = torch.randn(100, 48, dtype=torch.bfloat16) * 3
    for name in ("int8", "fp8"):
        whole = torch.nn.Linear(48, 100, bias=False, dtype=torch.bfloat16)
        whole.weight.data = w.clone()
        quantize_(whole, torchao_config(name))
        chunked = quantize_rows(w, name, rows=32)
        assert type(chunked) is type(whole.weight) and chunked.shape == w.shape
        assert torch.equal(chunked.dequantize(), whole.weight.dequantize())
        # the training matmul's own row dequantisation (no float32 copies) = torchao's, bit for bit
        assert torch.equal(dequantize_rows(chunked, 10, 70), whole.weight.dequantize()[10:70])


def _train(store_dir, model, out, quantize):
    cfg = load_config(None, {"train.device": "cpu", "train.dtype": "bfloat16", "train.max_steps": 2,
                             "train.batch_size": 2, "train.learning_rate": 2e-3, "train.lora.rank": 4,
                             "train.quantize_base": quantize})
    return run(cfg, store_dir, model, out)


@pytest.fixture(scope="module")
def plain_losses(store_dir, tiny_edit_model, tmp_path_factory):
    return _train(store_dir, tiny_edit_model, tmp_path_factory.mktemp("plain") / "run", "none").losses


# Loss of the same batches (or held-out rows) on the quantised vs the bf16 base, relative. Measured on the tiny
# model (the flow loss is mostly the noise target, so the differences are small): train int8 1.8e-4, fp8
# 4.3e-4, nf4 6.2e-4; evaluate int8 1.0e-4, nf4 4.4e-4. About 5x that.
LOSS_RTOL = {"int8": 1e-3, "fp8": 2e-3, "nf4": 3e-3}


@pytest.mark.parametrize("quantize", ["int8", "fp8", "nf4"])
def test_lora_from_a_quantized_base_loads_on_the_plain_base(quantize, store_dir, tiny_edit_model, tmp_path,
                                                            plain_losses):
    from diffusers import QwenImageEditPipeline

    result = _train(store_dir, tiny_edit_model, tmp_path / quantize, quantize)
    assert all(torch.isfinite(torch.tensor(result.losses)))
    # the same batches and noise as on the bf16 base: the losses differ by the quantisation error only
    assert result.losses == pytest.approx(plain_losses, rel=LOSS_RTOL[quantize])
    assert result.losses != plain_losses  # the base really was quantised
    saved, _ = read_lora(result.lora_dir)
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # it trained

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model)  # plain float32 base, stock loader
    pipe.load_lora_weights(result.lora_dir)
    assert not is_quantized(pipe.transformer.transformer_blocks[0].attn.to_q.base_layer.weight)
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if ".lora_" in n}
    for key, value in saved.items():
        name = key.removeprefix("transformer.").replace(".weight", ".default_0.weight")
        assert torch.equal(loaded[name].detach(), value), key


@pytest.mark.parametrize("quantize", ["none", "int8", "nf4"])
def test_offloaded_blocks_train_the_same_lora(quantize, store_dir, tiny_edit_model, tmp_path):
    """offload=blocks (storage and compute on the CPU, every onload a real copy) = no offload, bit for bit.
    (nf4: the offloaded weights lost their NF4 statistics and the first forward failed.)"""
    if quantize == "nf4":
        pytest.importorskip("bitsandbytes")

    base = {"train.device": "cpu", "train.max_steps": 2, "train.batch_size": 2, "train.learning_rate": 2e-3,
            "train.lora.rank": 4, "train.gradient_checkpointing": True, "train.quantize_base": quantize}
    plain = run(load_config(None, base), store_dir, tiny_edit_model, tmp_path / "plain")
    with offloaders_built() as seen:
        off = run(load_config(None, {**base, "train.offload": "blocks", "train.offload_blocks_on_device": 1,
                                     "train.gradient_checkpointing": False}),
                  store_dir, tiny_edit_model, tmp_path / "off")
    (offloader,) = seen
    assert offloader.always_copy and list(offloader.blocks) == [1]  # block 0 resident, block 1 streamed
    # forward + recompute per micro-batch and step
    assert offloader.onloads >= 2 * 2
    assert_same_training(plain, off)


@pytest.mark.parametrize("quantize", ["int8", "fp8", "nf4"])
def test_quantized_backward_keeps_no_dense_copy(quantize, tiny_edit_model):
    """The input gradient through a frozen quantised linear equals the dense-dequantised reference, and
    autograd saves only the quantised weight (not a dense copy of it)."""
    from models.quantize import install_frozen_linear_backward

    tr = load_component(tiny_edit_model, "transformer", dtype=torch.bfloat16, device="cpu", quantize=quantize)
    lin = tr.transformer_blocks[0].img_mlp.net[2]
    dense = dequantize(lin.weight).float()
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


# peft's "TorchaoLoraLinear ... cannot merge" warning was printed by every evaluate on an int8 base (nothing merges
# into a quantised base: models/lora.py)
@pytest.mark.filterwarnings("error:TorchaoLoraLinear was instantiated")
@pytest.mark.parametrize("quantize", ["int8", "nf4"])
def test_evaluate_loss_on_a_quantized_base(quantize, store_dir, tiny_edit_model, tmp_path):
    """evaluate (and predict: the same loader) with quantize_base: the held-out loss of base and LoRA on the
    quantised base is close to that on the bf16 base, with a LoRA attached by the stages' own loader."""
    from models.lora import attach_lora
    from models.multires import install_multires
    from models.sample import TrainSample
    from schemas.config import EvaluateConfig
    from stages.evaluate.loss_section import held_out_loss

    lora = _train(store_dir, tiny_edit_model, tmp_path / "lora", "none").lora_dir
    g = torch.Generator().manual_seed(0)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    sample = TrainSample(key="k" * 32, target=bf(4, 1, 8, 6), controls=[bf(4, 1, 8, 8)], prompt_embeds=bf(9, 32),
                         empty_embeds=bf(5, 32), img_shapes=[(1, 4, 3), (1, 4, 4)])
    cfg = EvaluateConfig(timesteps=[0.3, 0.7], noise_seeds=[0], dtype="bfloat16")
    losses = {}
    for q in ("none", quantize):
        tr = load_component(tiny_edit_model, "transformer", dtype=torch.bfloat16, device="cpu", quantize=q)
        install_multires(tr)
        attach_lora(tr, lora)
        with torch.no_grad():
            overall = held_out_loss(tr, [sample], cfg)["overall"]
        losses[q] = (overall["base"], overall["lora"])
    assert losses[quantize] == pytest.approx(losses["none"], rel=LOSS_RTOL[quantize])
    assert losses[quantize] != losses["none"]


def test_quantized_input_gradient_has_the_dense_bf16_error(monkeypatch):
    """The input gradient of the chunked quantised linear over many chunks is accumulated in float32 and rounded
    once: its error against a float32 reference (same dequantised weight) is that of one dense bf16 matmul, not
    the chunk count times larger (issue 24.6: 3.2x at the real width when chunks were summed in bf16)."""
    from models import quantize as qmod

    torch.manual_seed(0)
    monkeypatch.setattr(qmod, "DEQUANT_ELEMENTS", 16 * 256)  # 16-row chunks: 32 chunks of a 512 x 256 weight
    lin = torch.nn.Linear(256, 512, bias=False, dtype=torch.bfloat16)
    lin.weight = torch.nn.Parameter(qmod.quantize_rows(lin.weight.detach(), "int8"), requires_grad=False)
    assert qmod.install_frozen_linear_backward(lin) == 1 and 512 // qmod.row_chunk(lin.weight) == 32
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(64, 512, dtype=torch.bfloat16)
    lin(x).backward(g)
    w = qmod.dequantize(lin.weight).to(torch.bfloat16)
    exact = g.float() @ w.float()
    dense_bf16 = g @ w  # what an unquantised bf16 base computes (one matmul, rounded once)

    def rel(a):
        return ((a.float() - exact).norm() / exact.norm()).item()

    assert rel(x.grad) <= 1.05 * rel(dense_bf16), (rel(x.grad), rel(dense_bf16))
