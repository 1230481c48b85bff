"""Quantised frozen base (train.quantize_base int8 / fp8): quantised while loading, trains, and the LoRA it
gives is a plain diffusers LoRA that loads onto the unquantised base (stock `load_lora_weights`)."""

from __future__ import annotations

import pytest
import torch

from models.loading import load_component
from models.lora_io import read_lora
from models.quantize import is_quantized
from pipeline.config import load_config
from stages.train import run
from train_store import make_train_store, mixed_specs


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_edit_model):
    root = tmp_path_factory.mktemp("qtrain") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(4))
    return root


def test_quantized_while_loading_blocks_only(tiny_edit_model, monkeypatch):
    from diffusers.quantizers.torchao import torchao_quantizer as tq

    # No quantize_ over a materialised model: each linear is quantised on its own as its weight is read.
    calls, original = [], tq.quantize_
    monkeypatch.setattr(tq, "quantize_", lambda module, *a, **k: calls.append(module) or original(module, *a, **k))
    tr = load_component(tiny_edit_model, "transformer", dtype=torch.bfloat16, device="cpu", quantize="fp8")
    assert calls and all(isinstance(m, torch.nn.Linear) for m in calls)
    assert "Float8" in type(tr.transformer_blocks[0].attn.to_q.weight).__name__
    assert is_quantized(tr.transformer_blocks[0].img_mlp.net[2].weight)
    assert not is_quantized(tr.img_in.weight) and not is_quantized(tr.proj_out.weight)  # in/out stay exact
    plain = load_component(tiny_edit_model, "transformer", dtype=torch.bfloat16, device="cpu")
    x = torch.randn(3, plain.transformer_blocks[0].attn.to_q.in_features, dtype=torch.bfloat16)
    ref = plain.transformer_blocks[0].attn.to_q(x)
    got = tr.transformer_blocks[0].attn.to_q(x)
    assert (got - ref).abs().max() <= 0.1 * ref.abs().max()  # fp8 e4m3: a few % per weight


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
