"""LoHa / LoKr adapters on an NF4 base: refused in one line (peft shapes them by the packed 4-bit codes)."""

from __future__ import annotations

import pytest
import torch

from models.loading import load_component
from models.lora import add_lora, attach_lora, lora_parameters, save_lora
from schemas import UserError
from schemas.config import LoraConfig


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_a_lycoris_adapter_on_an_nf4_base_is_refused_in_one_line(kind, tiny_edit_model, tmp_path):
    """Before: add_lora built LoHa factors at the packed codes' shape ([out x in / 2, 1]) and LoKr's delta could
    not be reshaped to it; the first forward failed in peft with a bare shape error (RuntimeError). The same
    adapter on an int8 base, and LoRA on the NF4 base, train as before."""
    pytest.importorskip("bitsandbytes")
    cfg = LoraConfig(rank=2, kind=kind, target_modules=["to_q"])
    nf4 = load_component(tiny_edit_model, "transformer", dtype=torch.float32, device="cpu", quantize="nf4")
    with pytest.raises(UserError, match=f"train.lora.kind {kind} on an NF4 base") as e:
        add_lora(nf4, cfg)
    assert "\n" not in str(e.value)

    plain = load_component(tiny_edit_model, "transformer", dtype=torch.float32, device="cpu")
    add_lora(plain, cfg)
    for p in lora_parameters(plain):
        p.data = torch.full_like(p, 0.1)
    save_lora(plain, tmp_path / "lora")
    nf4 = load_component(tiny_edit_model, "transformer", dtype=torch.float32, device="cpu", quantize="nf4")
    with pytest.raises(UserError, match=f"a {kind.upper()} adapter.* on an NF4 base"):
        attach_lora(nf4, tmp_path / "lora" / "pytorch_lora_weights.safetensors")

    int8 = load_component(tiny_edit_model, "transformer", dtype=torch.float32, device="cpu", quantize="int8")
    add_lora(int8, cfg)  # torchao's weights report their logical shape: peft builds the adapter
    add_lora(load_component(tiny_edit_model, "transformer", dtype=torch.float32, device="cpu", quantize="nf4"),
             LoraConfig(rank=2, target_modules=["to_q"]))
