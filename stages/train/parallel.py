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

import re
from contextlib import nullcontext

import torch
from torch import nn

# LoRA'd layers whose outputs always reach the loss, per family (a layer's name below `transformer_blocks.<i>.`).
# Edit: the image stream's attention; the text stream's output of the last block (to_add_out, txt_mlp) feeds
# nothing. 2.1 has one stream: every token, the target's included, passes each block's attention and MLP.
# A LoRA'd layer outside these may get no gradient, which DDP must be told about (find_unused_parameters, an extra
# graph walk every step).
_ALWAYS_USED = {
    "edit": {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"},
    "qwen-image-2.1": {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                       "img_mlp.proj", "img_mlp.gate_layer", "img_mlp.out"},
}
_IN_A_BLOCK = re.compile(r"(?:^|\.)transformer_blocks\.\d+\.(.+)$")


def may_leave_unused(transformer: nn.Module) -> bool:
    """Whether a LoRA'd layer of `transformer` may get no gradient in a step (DDP's find_unused_parameters)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from models.qwen21_flow import is_qwen21

    used = _ALWAYS_USED["qwen-image-2.1" if is_qwen21(transformer) else "edit"]
    for name, module in transformer.named_modules():
        if isinstance(module, BaseTunerLayer):
            in_block = _IN_A_BLOCK.search(name)
            if in_block is None or in_block.group(1) not in used:
                return True
    return False


def wrap(transformer: nn.Module, world: int) -> nn.Module:
    """The DDP wrapper for several processes, the bare model for one."""
    if world == 1:
        return transformer
    from torch.nn.parallel import DistributedDataParallel

    frozen = [name for name, p in transformer.named_parameters() if not p.requires_grad]
    frozen += [name for name, _ in transformer.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(transformer, frozen)
    return DistributedDataParallel(
        transformer, device_ids=None, **_no_buffer_sync(DistributedDataParallel),
        find_unused_parameters=may_leave_unused(transformer),
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
