"""Quantised frozen base weights, applied while the checkpoint loads.

diffusers' `TorchAoConfig` (torchao weight-only int8 / float8) hands each linear weight to torchao as its
shard is read, so the full bf16 transformer is never materialised first (peak = quantised model + one
shard); quantising after `from_pretrained` would first hold the whole bf16 model. Only the transformer
blocks' linears are quantised: the input/output projections, norms and time embedding are ~2% of the
weights and stay exact. Trained LoRAs are plain peft/diffusers LoRAs and load onto an unquantised base.

4-bit: torchao's int4 weight-only needs a CUDA kernel package (not usable on the CPU here); bitsandbytes NF4
was not installable in this environment, so no 4-bit option is offered (see docs/train.md).
"""

from __future__ import annotations

from typing import Literal

QuantizeName = Literal["none", "int8", "fp8"]

# Modules kept in the load dtype (matched by name fragment, as diffusers' modules_to_not_convert does).
KEEP_EXACT = ["img_in", "txt_in", "proj_out", "norm_out", "time_text_embed"]

# Stored bytes per quantised weight element, and per-output-channel scale bytes (for memory planning).
BYTES_PER_WEIGHT = {"int8": 1.0, "fp8": 1.0}


def canonical(name: str) -> QuantizeName:
    return "int8" if name == "int8_weight_only" else name  # type: ignore[return-value]


def torchao_config(name: str):
    """The torchao weight-only config for a quantize setting (None for `none`)."""
    name = canonical(name)
    if name == "none":
        return None
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    return {"int8": Int8WeightOnlyConfig, "fp8": Float8WeightOnlyConfig}[name]()


def quantization_config(name: str):
    """What `from_pretrained(quantization_config=...)` takes to quantise the transformer blocks while loading."""
    ao = torchao_config(name)
    if ao is None:
        return None
    from diffusers import TorchAoConfig

    return TorchAoConfig(ao, modules_to_not_convert=list(KEEP_EXACT))


def is_quantized(weight) -> bool:
    return type(weight).__module__.startswith("torchao")
