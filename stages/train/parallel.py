"""Data parallel: PyTorch DistributedDataParallel around the LoRA'd transformer (torch's own bucketing, the
all-reduce overlapped with backward, `no_sync` for accumulation micro-batches).

Only the trainable LoRA parameters take part: the frozen base (and its buffers) is registered as ignored, so
DDP neither broadcasts the 20B base weights at start nor allocates buckets for them (and an int8 torchao base,
which DDP could not broadcast, is fine). Every rank builds the same LoRA from the same seed, so the start
broadcast of the LoRA changes nothing.

`device_ids=None` (one device per process): DDP then leaves the forward's inputs as they are; with
`device_ids` it would rebuild `img_shapes` (list / tuple subclasses that carry the padding markers of
`models.multires`) as plain lists.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

# LoRA targets whose outputs always reach the loss. LoRA on the text-stream output of the last block (or other
# modules) may get no gradient, which DDP must be told about (find_unused_parameters, an extra graph walk).
_ALWAYS_USED = {"to_q", "to_k", "to_v", "to_out.0"}


def wrap(transformer: nn.Module, world: int, target_modules: list[str]) -> nn.Module:
    """The DDP wrapper for several processes, the bare model for one."""
    if world == 1:
        return transformer
    from torch.nn.parallel import DistributedDataParallel

    frozen = [name for name, p in transformer.named_parameters() if not p.requires_grad]
    frozen += [name for name, _ in transformer.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(transformer, frozen)
    return DistributedDataParallel(
        transformer, device_ids=None, **_no_buffer_sync(DistributedDataParallel),
        find_unused_parameters=not set(target_modules) <= _ALWAYS_USED,
    )


def _no_buffer_sync(ddp_class) -> dict:
    """No buffer broadcast in forward. Every buffer is on the ignore list above (frozen, identical on all ranks),
    so the init sync has nothing to send either way; torch >= 2.13 deprecates `broadcast_buffers` with a
    FutureWarning on every rank, so the new name is used where it exists."""
    import inspect

    if "forward_sync_buffers" in inspect.signature(ddp_class.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def accumulating(model: nn.Module, last: bool):
    """No gradient all-reduce on accumulation micro-batches, only on the step's last backward."""
    no_sync = getattr(model, "no_sync", None)
    return nullcontext() if last or no_sync is None else no_sync()


def sum_over_ranks(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(t)
    return t
