"""DDP's search for unused parameters (find_unused_parameters, a graph walk every step) is on exactly when a LoRA'd
layer may get no gradient: checked against a real backward of each family's tiny model (stages/train/parallel.py)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from stages.train.parallel import wrap
from tests.models.block_activations import run_sample

DEFAULT = ["to_q", "to_k", "to_v", "to_out.0"]


def tiny_lora_model(family: str, targets: list[str]):
    from diffusers import QwenImage21Transformer2DModel, QwenImageTransformer2DModel

    from models.lora import add_lora
    from models.tiny import TINY_TRANSFORMER
    from models.tiny21 import TINY_TRANSFORMER_21
    from schemas.config import LoraConfig

    torch.manual_seed(0)
    if family == "qwen-image-2.1":
        from models.qwen21_multires import install_qwen21

        model = QwenImage21Transformer2DModel(**TINY_TRANSFORMER_21)
        install_qwen21(model)
    else:
        from models.multires import install_multires

        model = QwenImageTransformer2DModel(**TINY_TRANSFORMER)
        install_multires(model)
    add_lora(model, LoraConfig(target_modules=targets))
    return model.train()


def without_gradient(model) -> list[str]:
    """The LoRA parameters one training step's backward leaves without a gradient (what DDP calls unused)."""
    _, out = run_sample(model, 96)
    out.float().sum().backward()
    return [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]


@pytest.fixture(scope="module")
def one_process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("family, targets, searches", [
    ("qwen-image-2.1", DEFAULT, False),
    # 2.1 is one stream: every token passes each block's MLP, the last block's included
    ("qwen-image-2.1", DEFAULT + ["proj", "gate_layer", "out"], False),
    ("qwen-image-2.1", ["attn.to_q", "img_mlp.out"], False),
    ("edit", DEFAULT, False),
    # the Edit model's last block: its text stream's output reaches nothing
    ("edit", DEFAULT + ["to_add_out"], True),
    ("edit", DEFAULT + ["net.0.proj", "net.2"], True),
])
def test_unused_search_only_where_a_lora_layer_gets_no_gradient(one_process_group, family, targets, searches):
    model = tiny_lora_model(family, targets)
    unused = without_gradient(model)
    assert bool(unused) == searches, unused
    model.zero_grad(set_to_none=True)
    assert wrap(model, 2).find_unused_parameters is searches
