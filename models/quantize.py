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

4-bit (`nf4`): bitsandbytes' NF4 (blocks of 64 weights, one float32 absmax each, no double quantisation) in
its own `Params4bit` format, quantised ROWS rows at a time by `bitsandbytes.functional.quantize_4bit` (the
chunks join exactly into the whole-tensor result when a chunk starts on a block boundary). The matmul is not
bitsandbytes' `matmul_4bit` (it dequantises the whole weight per call, and once more in the backward): every
quantised linear (torchao and NF4 alike) runs through `_FrozenQuantizedLinear` below. torchao's int4 needs a
CUDA kernel package (not usable on the CPU here).
"""

from __future__ import annotations

import functools
from typing import Literal

QuantizeName = Literal["none", "int8", "fp8", "nf4"]

# Output rows quantised at a time while loading: bounds the dense temporaries to ROWS x in_features (torchao
# works on a whole weight through float32 copies: ~340 MB for one 3072 x 18432 modulation linear).
ROWS = 1024
# Dense weight elements dequantised at a time in a matmul. Forward and backward run while every saved
# activation is alive, so these temporaries sit on top of the training peak: torchao dequantises through a
# float32 copy, so 1024 rows of a 12288-wide MLP weight were 50 MB float32 + 25 MB bf16 at the peak (measured
# 2 layers: int8 1.25 GiB peak over baseline, of which ~0.15 GiB such temporaries). 2**21 elements: 8 MB
# float32 + 4 MB bf16, and a row chunk of the largest weight is still a matmul of >= 170 rows.
DEQUANT_ELEMENTS = 1 << 21
# NF4 block size (values per absmax): bitsandbytes' default for 4-bit.
NF4_BLOCK = 64

# Modules kept in the load dtype (matched by name fragment, as diffusers' modules_to_not_convert does).
KEEP_EXACT = ["img_in", "txt_in", "proj_out", "norm_out", "time_text_embed"]


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


def _nf4_row_step(in_features: int) -> int:
    """Rows per NF4 block boundary: a row chunk that starts at a multiple of this starts a new block."""
    import math

    return NF4_BLOCK // math.gcd(in_features, NF4_BLOCK)


def _quantize_nf4_chunk(chunk):
    from bitsandbytes.functional import quantize_4bit

    return quantize_4bit(chunk.contiguous(), blocksize=NF4_BLOCK, quant_type="nf4", compress_statistics=False)


def _join_nf4(parts: list, shape, dtype):
    """One bitsandbytes `Params4bit` (the packed 4-bit codes and the absmax of the whole weight) from row
    chunks that each start on a block boundary: equal to quantising the whole weight at once."""
    import torch
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Params4bit

    packed = torch.cat([p.reshape(-1) for p, _ in parts]).reshape(-1, 1)
    state = QuantState(absmax=torch.cat([s.absmax for _, s in parts]), shape=torch.Size(shape), code=parts[0][1].code,
                       blocksize=NF4_BLOCK, quant_type="nf4", dtype=dtype)
    return Params4bit(packed, requires_grad=False, quant_state=state, blocksize=NF4_BLOCK, compress_statistics=False,
                      quant_type="nf4", quant_storage=torch.uint8, bnb_quantized=True)


def quantize_rows_nf4(weight, rows: int | None = None):
    """NF4 of a 2-D weight, `rows` rows at a time (rounded to a block boundary), as one `Params4bit`."""
    step = _nf4_row_step(weight.shape[1])
    rows = max(step, (rows or ROWS) // step * step)
    return _join_nf4([_quantize_nf4_chunk(weight[i : i + rows]) for i in range(0, weight.shape[0], rows)],
                     weight.shape, weight.dtype)


def is_nf4(weight) -> bool:
    return type(weight).__name__ == "Params4bit" and type(weight).__module__.startswith("bitsandbytes")


def nf4_map(weight, fn):
    """A new `Params4bit` whose packed codes and absmax / code table are `fn` of the weight's (a device copy, a
    pinned copy), with its own QuantState: bitsandbytes' `Params4bit.to` moves the QuantState it shares with the
    original in place (a device copy would take the host weight's statistics along), and wrapping a Params4bit
    in a plain `nn.Parameter` drops the QuantState altogether."""
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Params4bit

    s = weight.quant_state
    if s.nested:
        raise ValueError("nf4_map: a double-quantised (nested) QuantState is not produced here")
    state = QuantState(absmax=fn(s.absmax), shape=s.shape, code=fn(s.code), blocksize=s.blocksize,
                       quant_type=s.quant_type, dtype=s.dtype)
    data = fn(weight.data)  # the packed codes as a plain tensor
    return Params4bit(data, requires_grad=False, quant_state=state, blocksize=s.blocksize, compress_statistics=False,
                      quant_type=s.quant_type, quant_storage=data.dtype, bnb_quantized=True)


def plain_tensors_nf4(weight) -> list:
    """The plain tensors holding an NF4 weight's memory (codes, absmax, code table)."""
    return [weight.data, weight.quant_state.absmax, weight.quant_state.code]


def compute_dtype(weight):
    """The dense dtype a quantised weight dequantises to (the load dtype)."""
    return weight.quant_state.dtype if is_nf4(weight) else weight.dtype


def out_in_features(weight) -> tuple[int, int]:
    shape = weight.quant_state.shape if is_nf4(weight) else weight.shape
    return int(shape[0]), int(shape[1])


def dequantize_rows(weight, start: int, stop: int):
    """Rows start:stop of a quantised weight, dense in its load dtype (only those rows are dequantised)."""
    if not is_nf4(weight):
        return _dequantize_torchao_rows(weight, start, stop)
    import torch
    from bitsandbytes.functional import QuantState, dequantize_4bit

    state = weight.quant_state
    n, k = out_in_features(weight)
    stop = min(stop, n)
    lo, hi = start * k, stop * k  # flat element range, starting on a block boundary (`_nf4_row_step`)
    # Dequantised as a flat run of blocks: bitsandbytes 0.50.2's CPU kernel, given a 2-D shape whose rows are
    # not a whole number of blocks, indexes the absmax per row and returns wrong values (0.18 mean abs error
    # vs 0.07 for a 100 x 96 randn weight; checked against code[nibble] x absmax[block] by hand).
    part = QuantState(absmax=state.absmax[lo // NF4_BLOCK : -(-hi // NF4_BLOCK)], shape=torch.Size((hi - lo,)),
                      code=state.code, blocksize=NF4_BLOCK, quant_type="nf4", dtype=state.dtype)
    return dequantize_4bit(weight.data[lo // 2 : hi // 2], part).reshape(stop - start, k)


def _dequantize_torchao_rows(weight, start: int, stop: int):
    """Rows of a per-output-channel torchao Int8Tensor / Float8Tensor as qdata x scale in one dense buffer of
    the load dtype. torchao's own `dequantize` goes through float32 copies (and an int8 zero point of 0):
    ~25 MB of temporaries per 2**21-element chunk on top of the training peak. Bit for bit equal to it
    (tested); any other layout falls back to it."""
    import torch

    names = weight.__tensor_flatten__()[0]
    zero = getattr(weight, "zero_point", None)
    per_row = getattr(weight, "block_size", None) == [1, weight.shape[1]] and weight.scale.numel() == weight.shape[0]
    if (weight.device.type != "cpu" or not per_row or not set(names) <= {"qdata", "scale", "zero_point"}
            or (zero is not None and zero[start:stop].any())):
        return weight[start:stop].dequantize()  # on a GPU a few MB of float32 temporaries beat 100 small kernels
    qdata, scale = weight.qdata[start:stop], weight.scale[start:stop].reshape(-1, 1)
    out = torch.empty(qdata.shape, dtype=weight.dtype, device=qdata.device)
    # torchao's own arithmetic (float32 value x float32 scale, rounded once to the load dtype), a few rows at a
    # time so the float32 temporaries stay ~1 MB (a mixed-dtype in-place multiply would take the slow
    # element-by-element casting path: 10x slower, measured)
    step = max(1, (1 << 18) // max(1, qdata.shape[1]))
    for i in range(0, qdata.shape[0], step):
        out[i : i + step] = qdata[i : i + step].to(torch.float32).mul_(scale[i : i + step])
    return out


def stored_bytes(t) -> int:
    """Bytes a (possibly quantised) parameter holds: NF4 codes + absmax, a torchao tensor's inner tensors."""
    import torch

    if is_nf4(t):
        return t.data.numel() * t.data.element_size() + t.quant_state.absmax.numel() * t.quant_state.absmax.element_size()
    if is_quantized(t):
        return sum(stored_bytes(getattr(t, n)) for n in t.__tensor_flatten__()[0])
    t = t.data if isinstance(t, torch.nn.Parameter) else t
    return t.numel() * t.element_size()


def dequantize(weight):
    """The whole dense weight (tests, references; training never forms it)."""
    return dequantize_rows(weight, 0, out_in_features(weight)[0])


def row_chunk(weight) -> int:
    """Rows per dequantised chunk in a matmul: DEQUANT_ELEMENTS dense elements, on an NF4 block boundary."""
    _, k = out_in_features(weight)
    step = _nf4_row_step(k) if is_nf4(weight) else 1
    return max(step, DEQUANT_ELEMENTS // k // step * step)


def quantized_weight_names(model) -> set[str]:
    import torch

    return {f"{n}.weight" for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.startswith("transformer_blocks.")
            and not any(k in n for k in KEEP_EXACT)}


def check_installed(name: str, what: str) -> None:
    """The package a quantize setting needs beyond the core install (nf4: bitsandbytes), or a UserError naming the
    setting `what`: where the base loads, and at `pipeline run all`'s start (before its first stage, not after
    resize-bucket, the encoders and, for evaluate's, the training)."""
    if canonical(name) == "nf4":
        from models.optional import require

        require("bitsandbytes", f"{what} 'nf4'")


def load_quantized_transformer(folder, dtype, device, name: str):
    """The stock transformer class, built on the meta device and filled shard by shard, block linears
    quantised as they are read (see the module docstring)."""
    from pathlib import Path

    from tqdm.auto import tqdm

    folder = Path(folder)
    model = _empty_transformer(folder)
    to_quantize = quantized_weight_names(model)
    expected = {n for n, _ in model.named_parameters()}
    seen = set()
    name = canonical(name)
    check_installed(name, "quantize_base")  # before any weight is read
    cfg = None if name == "nf4" else torchao_config(name)
    on_gpu = str(device).startswith("cuda")
    for file in tqdm(_weight_files(folder), desc=f"load transformer ({name})", unit="shard", leave=False):
        for key in _tensor_names(folder / file):
            weight = _read_weight(folder / file, key, key in to_quantize, name, cfg, device, dtype)
            _set_frozen_parameter(model, key, weight)
            seen.add(key)
        if on_gpu:  # freed device chunks the cycles hold: their effect on the device peak is not measured yet
            _collect_garbage()
    if not on_gpu:
        _collect_garbage()
    if expected - seen:
        from schemas.errors import UserError

        raise UserError(f"{folder}: the checkpoint lacks {len(expected - seen)} transformer weights "
                        f"(e.g. {sorted(expected - seen)[:3]}): an incomplete or different model folder")
    _buffers_to(model, device)
    install_frozen_linear_backward(model)  # NF4 weights have no linear of their own; torchao's saves a dense copy
    return model.eval()


def _buffers_to(model, device) -> None:
    """Every buffer onto `device` in its own dtype, as the unquantised load's device_map places them: the empty
    model made its buffers on the CPU (no weight file fills a non-persistent one, e.g. Qwen-Image-2.1's
    time_proj.freqs, float32), and a CPU buffer of a GPU model is copied to the device at every forward."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def _collect_garbage() -> None:
    """A full collection: torchao's quantise leaves reference cycles holding freed chunks (measured: 0.11 GiB).
    On the CPU once the model is loaded, not after every shard: each full collection walks the whole process's
    heap (9 x ~0.9 s in int8 rehearsals) and the per-shard ones lowered no peak RSS (bench/quantized_load_gc.py:
    the interpreter's own young-generation collections free those cycles as the load goes). On a GPU still after
    every shard: those cycles may hold freed device memory, whose peak the bench could not measure on a CPU (the
    GPU proof's 24 GB int8 configuration is where 0.11 GiB a shard would count)."""
    import gc

    gc.collect()


def _empty_transformer(folder):
    """The class the folder names (Qwen-Image-2.1: QwenImage21Transformer2DModel; the Edit one by default),
    built from its config on the meta device: no weight allocated."""
    import diffusers
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel

    with init_empty_weights():
        config = QwenImageTransformer2DModel.load_config(folder)
        cls = getattr(diffusers, config.get("_class_name", ""), QwenImageTransformer2DModel)
        return cls.from_config(config)


def _weight_files(folder) -> list[str]:
    """The folder's safetensors files: those its index names, or the single file."""
    import json

    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    return (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
            else ["diffusion_pytorch_model.safetensors"])


def _tensor_names(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        return list(f.keys())


def _read_weight(path, key: str, quantize: bool, name: str, cfg, device, dtype):
    """One weight of one file, on `device`: quantised ROWS rows at a time (no whole bf16 weight), or a copy."""
    from safetensors import safe_open

    # One mapping per tensor, closed when this returns: the file pages read stay in this process's RSS
    # only while mapped, so at most one weight's pages are resident on top of the quantised model.
    with safe_open(str(path), framework="pt", device="cpu") as f:
        if quantize:
            sl = f.get_slice(key)
            return _quantize_rows(sl, sl.get_shape(), name, cfg, device, dtype)
        return f.get_tensor(key).to(device=device, dtype=dtype, copy=True)  # a copy: a view keeps the file mapped


def _quantize_rows(sl, shape, name: str, cfg, device, dtype):
    """A weight read as row slices and quantised chunk by chunk (NF4 on its block boundary, torchao per ROWS)."""
    if name == "nf4":
        step = _nf4_row_step(shape[1])
        rows = max(step, ROWS // step * step)
        return _join_nf4([_quantize_nf4_chunk(sl[i : i + rows].to(device=device, dtype=dtype))
                          for i in range(0, shape[0], rows)], shape, dtype)
    return _join_rows([_quantize_chunk(sl[i : i + ROWS].to(device=device, dtype=dtype), cfg)
                       for i in range(0, shape[0], ROWS)], shape)


def _set_frozen_parameter(model, key: str, weight) -> None:
    import torch

    owner, _, pname = key.rpartition(".")
    # a Params4bit is a Parameter already (re-wrapping would drop its quant_state)
    model.get_submodule(owner)._parameters[pname] = (weight if is_nf4(weight)
                                                      else torch.nn.Parameter(weight, requires_grad=False))


def quantization_config(name: str):
    """What `from_pretrained(quantization_config=...)` takes to quantise the transformer blocks while loading
    (torchao kinds: the reference the tests compare this module's loader with)."""
    ao = torchao_config(name)
    if ao is None:
        return None
    from diffusers import TorchAoConfig

    return TorchAoConfig(ao, modules_to_not_convert=list(KEEP_EXACT))


def is_quantized(weight) -> bool:
    return type(weight).__module__.startswith("torchao") or is_nf4(weight)


def _chunked_linear(x, weight, bias):
    """x W^T + b with W dequantised `row_chunk` output rows at a time, written into one preallocated output
    (a list of chunk outputs joined by torch.cat would hold the output twice)."""
    import torch

    n, _ = out_in_features(weight)
    rows = row_chunk(weight)
    out = x.new_empty(*x.shape[:-1], n)
    for start in range(0, n, rows):
        w = dequantize_rows(weight, start, start + rows).to(x.dtype)
        out[..., start : start + rows] = torch.nn.functional.linear(
            x, w, None if bias is None else bias[start : start + rows].to(x.dtype))
        del w
    return out


def _chunked_input_grad(grad, weight):
    """grad W, accumulated in place chunk by chunk (addmm_: no second full-size partial product).

    The sum runs in float32 and is rounded to the gradient's dtype once: summed in bf16, every chunk's partial
    sum was rounded again (19-28 chunks at the real width: 3.2x the error of a dense bf16 matmul; float32
    accumulation gives the dense figure). Cost: a float32 output (and on the CPU one float32 chunk of each
    operand)."""
    import torch

    n, k = out_in_features(weight)
    rows = row_chunk(weight)
    g = grad.reshape(-1, n)
    out = g.new_zeros(g.shape[0], k, dtype=torch.float32)
    for start in range(0, n, rows):
        _accumulate(out, g[:, start : start + rows], dequantize_rows(weight, start, start + rows).to(g.dtype))
    return out.to(grad.dtype).reshape(*grad.shape[:-1], k)


def _accumulate(out, a, b) -> None:
    """out += a @ b, `out` float32. On CUDA the half-precision operands go to the tensor cores with float32
    accumulation straight into `out` (addmm's out_dtype); float32 operands there run ~13x slower on an H200
    and made int8/fp8 training 2.6x slower than bf16 (measured, docs/gpu.md). The CPU has no such kernel and
    gains nothing from bf16: float32 operands."""
    import torch

    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _has_out_dtype():
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        out.addmm_(a.float(), b.float())


@functools.cache
def _has_out_dtype() -> bool:
    import torch

    return "dtype_out" in torch.ops.aten.addmm.overloads()


class _FrozenQuantizedLinear:
    """y = x W^T + b for a frozen torchao-quantised W, keeping only the quantised W for the backward.

    torchao's weight-only linear dequantises W and calls F.linear with the dense copy, so autograd saves that
    dense bf16 copy for the input gradient: every block's full-precision weights would then live until the
    backward, and training would need more memory than the unquantised base. This Function saves the
    quantised tensor and dequantises `row_chunk` output rows at a time, in the forward and in the backward,
    so no dequantised chunk outlives its matmul. (An NF4 `Params4bit` has no linear of its own at all.)
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
    """Route every quantised nn.Linear of `model` through `_FrozenQuantizedLinear`; returns how many (the
    loader does it; calling it again is harmless)."""
    import torch

    fn = _FrozenQuantizedLinear.function()
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and is_quantized(module.weight) and not module.weight.requires_grad:
            def forward(x, m=module):
                # compute in the weight's (dequantised) dtype, as torchao's own linear requires
                x = x.to(compute_dtype(m.weight))
                if not torch.is_grad_enabled() or not x.requires_grad:
                    return _chunked_linear(x, m.weight, m.bias)
                return fn.apply(x, m.weight, m.bias)

            module.forward = forward
            n += 1
    return n
