"""Quantised frozen base weights, applied while the checkpoint loads.

`load_quantized_transformer` builds the transformer on the meta device and fills it one tensor at a time
from the safetensors shards: each block linear's bf16 weight is quantised (torchao weight-only int8 /
float8, per output channel) ROWS rows at a time as it is read, so neither the full bf16 model nor a
full-size float32 temporary ever exists. Peak while loading = the quantised model + one shard's mapped
pages + one weight. (diffusers' `TorchAoConfig` path also quantises per linear while loading, but its
torchao call quantises a whole 3072 x 18432 weight through float32 temporaries, and its zero-copy biases
keep every shard's mapping and read pages resident: measured 1.48 GiB peak over baseline for fp8 at 2 full
width layers, more than the 1.42 GiB bf16 model.) Only the transformer blocks' linears are quantised: the
input/output projections, norms and time embedding are ~2 % of the weights and stay exact. Trained LoRAs are
plain peft/diffusers LoRAs and load onto an unquantised base.

4-bit: torchao's int4 weight-only needs a CUDA kernel package (not usable on the CPU here); bitsandbytes
NF4 was not wired in (see docs/train.md), so no 4-bit option is offered.
"""

from __future__ import annotations

from typing import Literal

QuantizeName = Literal["none", "int8", "fp8"]

# Output rows quantised / dequantised at a time: bounds the dense temporaries to ROWS x in_features (torchao
# works on a whole weight through float32 copies: ~340 MB for one 3072 x 18432 modulation linear).
ROWS = 1024

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


def _quantize_chunk(chunk, cfg):
    import torch
    from torchao.quantization import quantize_

    lin = torch.nn.Linear(chunk.shape[1], chunk.shape[0], bias=False, device="meta")
    lin.weight = torch.nn.Parameter(chunk.contiguous(), requires_grad=False)
    quantize_(lin, cfg)
    return lin.weight.detach()


def _join_rows(parts: list, shape):
    """One torchao tensor from row chunks (torchao has no aten.cat for Int8Tensor: join the inner tensors)."""
    import torch

    if len(parts) == 1:
        return parts[0]
    names, meta = parts[0].__tensor_flatten__()
    inner = {n: torch.cat([getattr(p, n) for p in parts]) for n in names}
    return type(parts[0]).__tensor_unflatten__(inner, meta, torch.Size(shape), None)


def quantize_rows(weight, name: str, rows: int | None = None):
    """Per-output-channel weight-only quantisation of a 2-D weight, `rows` rows at a time; the chunks are
    joined into one torchao tensor (exact: each row's scale depends on that row only)."""
    cfg, rows = torchao_config(name), rows or ROWS
    return _join_rows([_quantize_chunk(weight[i : i + rows], cfg) for i in range(0, weight.shape[0], rows)],
                      weight.shape)


def quantized_weight_names(model) -> set[str]:
    import torch

    return {f"{n}.weight" for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.startswith("transformer_blocks.")
            and not any(k in n for k in KEEP_EXACT)}


def load_quantized_transformer(folder, dtype, device, name: str):
    """The stock transformer class, built on the meta device and filled shard by shard, block linears
    quantised as they are read (see the module docstring)."""
    import gc
    import json
    from pathlib import Path

    import torch
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel
    from safetensors import safe_open
    from tqdm.auto import tqdm

    folder = Path(folder)
    with init_empty_weights():
        model = QwenImageTransformer2DModel.from_config(QwenImageTransformer2DModel.load_config(folder))
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["diffusion_pytorch_model.safetensors"])
    to_quantize = quantized_weight_names(model)
    expected = {n for n, _ in model.named_parameters()}
    seen = set()
    cfg = torchao_config(name)

    def read_tensor(path: Path, key: str) -> None:
        # One mapping per tensor, closed when this returns: the file pages read stay in this process's RSS
        # only while mapped, so at most one weight's pages are resident on top of the quantised model.
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if key in to_quantize:  # ROWS rows read and quantised at a time: no whole bf16 weight
                sl = f.get_slice(key)
                shape = sl.get_shape()
                t = _join_rows([_quantize_chunk(sl[i : i + ROWS].to(device=device, dtype=dtype), cfg)
                                for i in range(0, shape[0], ROWS)], shape)
            else:  # a copy: a view would keep the file mapped
                t = f.get_tensor(key).to(device=device, dtype=dtype, copy=True)
        owner, _, pname = key.rpartition(".")
        model.get_submodule(owner)._parameters[pname] = torch.nn.Parameter(t, requires_grad=False)
        seen.add(key)

    for file in tqdm(files, desc=f"load transformer ({name})", unit="shard", leave=False):
        with safe_open(str(folder / file), framework="pt", device="cpu") as f:
            keys = list(f.keys())
        for key in keys:
            read_tensor(folder / file, key)
        gc.collect()  # torchao's quantise leaves reference cycles holding freed chunks (measured: 0.11 GiB)
    if expected - seen:
        from schemas.errors import UserError

        raise UserError(f"{folder}: the checkpoint lacks {len(expected - seen)} transformer weights "
                        f"(e.g. {sorted(expected - seen)[:3]}): an incomplete or different model folder")
    return model.eval()


def quantization_config(name: str):
    """What `from_pretrained(quantization_config=...)` takes to quantise the transformer blocks while loading."""
    ao = torchao_config(name)
    if ao is None:
        return None
    from diffusers import TorchAoConfig

    return TorchAoConfig(ao, modules_to_not_convert=list(KEEP_EXACT))


def is_quantized(weight) -> bool:
    return type(weight).__module__.startswith("torchao")




def _chunked_linear(x, weight, bias, rows: int | None = None):
    import torch

    rows = rows or ROWS
    outs = []
    for start in range(0, weight.shape[0], rows):
        w = weight[start : start + rows].dequantize().to(x.dtype)
        outs.append(torch.nn.functional.linear(x, w, None if bias is None else bias[start : start + rows].to(x.dtype)))
    return torch.cat(outs, dim=-1)


def _chunked_input_grad(grad, weight, rows: int | None = None):
    rows = rows or ROWS
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
