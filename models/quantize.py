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


# Output rows dequantised at a time: bounds the dense temporary to ROWS x in_features (torchao's own CPU path
# dequantises the whole weight through a float32 copy: 340 MB for one 3072 x 18432 modulation linear).
ROWS = 1024


def _chunked_linear(x, weight, bias, rows: int = ROWS):
    import torch

    outs = []
    for start in range(0, weight.shape[0], rows):
        w = weight[start : start + rows].dequantize().to(x.dtype)
        outs.append(torch.nn.functional.linear(x, w, None if bias is None else bias[start : start + rows].to(x.dtype)))
    return torch.cat(outs, dim=-1)


def _chunked_input_grad(grad, weight, rows: int = ROWS):
    out = None
    for start in range(0, weight.shape[0], rows):
        w = weight[start : start + rows].dequantize().to(grad.dtype)
        part = grad[..., start : start + rows] @ w
        out = part if out is None else out.add_(part)
    return out


class _FrozenQuantizedLinear:
    """y = x W^T + b for a frozen torchao-quantised W, keeping only the quantised W for the backward.

    torchao's weight-only linear dequantises W and calls F.linear with the dense copy, so autograd saves that
    dense bf16 copy for the input gradient: every block's full-precision weights would then live until the
    backward, and training would need more memory than the unquantised base. This Function saves the
    quantised tensor and dequantises ROWS output rows at a time, in the forward and in the backward.
    """

    @staticmethod
    def function():
        import torch

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, weight, bias):
                # saved (not a ctx attribute) so gradient checkpointing and offload can drop and refetch it
                ctx.save_for_backward(weight)
                return _chunked_linear(x, weight, bias)

            @staticmethod
            def backward(ctx, grad):
                (weight,) = ctx.saved_tensors
                return _chunked_input_grad(grad, weight), None, None

        return Fn


def install_frozen_linear_backward(model) -> int:
    """Route every torchao-quantised nn.Linear of `model` through `_FrozenQuantizedLinear`; returns how many."""
    import torch

    fn = _FrozenQuantizedLinear.function()
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and is_quantized(module.weight) and not module.weight.requires_grad:
            def forward(x, m=module):
                # compute in the weight's (dequantised) dtype, as torchao's own linear requires
                x = x.to(m.weight.dtype)
                if not torch.is_grad_enabled() or not x.requires_grad:
                    return _chunked_linear(x, m.weight, m.bias)
                return fn.apply(x, m.weight, m.bias)

            module.forward = forward
            n += 1
    return n
