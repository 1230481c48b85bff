"""Correctness stage, part `quantized_linear`: the quantised frozen linear's speed against the dense bf16 one,
per dequantisation chunk size, at the real model's shapes.

On the H200 (2026-12-04) an int8 base still trained 1.77x slower than bf16 after its input gradient went to
the tensor cores. What is left is models/quantize.py's chunking: a 3072 x 12288 MLP weight is dequantised
`DEQUANT_ELEMENTS` (2**21) elements at a time, so one linear is ~18 matmuls of 682 output rows in the
forward, again in the recompute, and its input gradient ~18 rank-682 updates of a float32 output (each one
reading and writing the whole output). Larger chunks mean fewer, better-shaped matmuls for more transient
memory. This part times forward + input-gradient backward of one linear (the frozen base: no weight
gradient) over a token count like one 1-MP sample with controls, for the chunk sizes below, against
`F.linear` on the dense bf16 weight, and records each one's peak memory above the inputs. A few seconds of
device time; what it shows decides the CUDA default, which is not changed before it is measured.
"""

from __future__ import annotations

import time
import traceback

import torch

# (in_features, out_features): the MLP's up and down projections and a 3072-square attention projection
SHAPES = [(3072, 12288), (12288, 3072), (3072, 3072)]
CHUNKS = [1 << 21, 1 << 23, 1 << 25, None]  # None: the whole weight at once
TOKENS = 16384  # one 1-MP target with a control or two (8-17 k tokens per sample on the bench's 8)


def _time(fn, device: torch.device, repeat: int) -> float:
    fn()  # warm-up: kernels chosen, allocator primed
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / repeat


def _peak_above(fn, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def run_quantized_linear(device: torch.device, smoke: bool, deadline: float, record) -> None:
    import models.quantize as qmod

    entry = record.setdefault("quantized_linear", {})
    shapes = [(32, 128), (128, 32)] if smoke else SHAPES
    tokens, repeat = (64, 1) if smoke else (TOKENS, 5)
    entry["tokens"] = tokens
    g = torch.Generator().manual_seed(5)
    for k, n in shapes:
        shape = f"{k}x{n}"
        w = (torch.randn(n, k, generator=g) / k**0.5).to(device, torch.bfloat16)
        x = torch.randn(tokens, k, generator=g).to(device, torch.bfloat16).requires_grad_(True)
        dy = torch.randn(tokens, n, generator=g).to(device, torch.bfloat16)

        def step(fn):
            def run():
                x.grad = None
                fn(x).backward(dy)
            return run

        dense = step(lambda a: torch.nn.functional.linear(a, w))
        row = entry.setdefault(shape, {})
        row["bfloat16_ms"] = _time(dense, device, repeat) * 1e3
        row["bfloat16_peak_bytes"] = _peak_above(dense, device)
        for kind in ("int8", "fp8"):
            if time.monotonic() > deadline:
                entry.setdefault("not_run_budget", []).append(f"{shape} {kind}")
                continue
            try:
                lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
                lin.weight = torch.nn.Parameter(qmod.quantize_rows(w, kind), requires_grad=False)
                qmod.install_frozen_linear_backward(lin)
                per = row.setdefault(kind, {})
                saved = qmod.DEQUANT_ELEMENTS
                try:
                    for chunk in CHUNKS:
                        qmod.DEQUANT_ELEMENTS = chunk or n * k
                        q = step(lin)
                        ms = _time(q, device, repeat) * 1e3
                        per[str(chunk or "whole")] = {"ms": ms, "x_bfloat16": ms / row["bfloat16_ms"],
                                                      "chunks": -(-n // qmod.row_chunk(lin.weight)),
                                                      "peak_bytes": _peak_above(q, device)}
                finally:
                    qmod.DEQUANT_ELEMENTS = saved
            except Exception as e:  # the chunks timed before the failure stay (one device call is precious)
                row.setdefault(kind, {}).update({"ran": False, "error": f"{type(e).__name__}: {str(e)[:400]}",
                                                 "where": traceback.format_exc(limit=-3)[-800:]})
            record.flush()
