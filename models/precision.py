"""Device-aware precision and device choice shared by every stage.

`dtype: auto` means bfloat16 on a CUDA device that supports it and float32 everywhere else: on a CPU bf16
matmuls/convs are emulated and several times slower (one 512x512 VAE encode: 3.0 s in float32, 18.4 s in
bf16), and on a GPU bf16 halves the memory of a 20B-parameter transformer. Stages resolve `auto` once, print
what they picked and record the concrete name (lineage config, run records), so a table or run says which
precision produced it.

`device` settings may be one name (`cpu`, `cuda`, `cuda:1`) or a per-rank list (`[cuda:0, cuda:1]`); `cuda`
under a multi-process launch means this rank's own GPU (`cuda:LOCAL_RANK`).
"""

from __future__ import annotations

import os
from typing import Literal, Sequence

import torch

from schemas.errors import UserError

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
DeviceSpec = str | list[str]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bf16_supported(device: str | torch.device) -> bool:
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    major, _ = torch.cuda.get_device_capability(index)
    return major >= 8 and torch.cuda.is_bf16_supported()  # Ampere and newer run bf16 natively


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """`auto` -> bf16 on a bf16-capable CUDA device, else float32; explicit names as given."""
    if name == "auto":
        return torch.bfloat16 if bf16_supported(device) else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}: use auto, float32, bfloat16 or float16") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}[dtype]


def resolved_name(name: str, device: str | torch.device) -> str:
    return dtype_name(resolve_dtype(name, device))


def local_rank() -> tuple[int, int]:
    """(local rank, world size) from the launcher's environment (accelerate / torchrun); (0, 1) otherwise."""
    return int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def device_for_rank(spec: DeviceSpec, rank: int | None = None, world_size: int | None = None,
                    what: str = "device") -> str:
    """This rank's device: a list gives one entry per local rank; `cuda` with several ranks is cuda:LOCAL_RANK."""
    env_rank, env_world = local_rank()
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise UserError(f"{what}: an empty device list; give one device per rank, e.g. [cuda:0, cuda:1]")
        if rank >= len(spec):
            raise UserError(f"{what}: {len(spec)} device(s) listed ({list(spec)}) but this is local rank {rank}: "
                            "list one device per process")
        return str(spec[rank])
    if spec == "cuda" and world_size > 1:
        return f"cuda:{rank}"
    return spec


def describe(stage: str, dtype: torch.dtype, device: str | torch.device, requested: str) -> str:
    how = "auto" if requested == "auto" else "set"
    return f"{stage}: {dtype_name(dtype)} on {device} ({how})"


def first_device(spec: DeviceSpec | None) -> str | None:
    """The device a single-process caller would use (for messages and device-type checks)."""
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        return str(spec[0]) if spec else None
    return spec
