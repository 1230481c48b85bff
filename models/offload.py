"""Frozen transformer blocks kept in (pinned) host memory and streamed to the compute device ahead of use.

Hand-written rather than diffusers' group offloading because that one swaps `param.data` back to the host
after each block's forward: autograd keeps the *same* parameter object for the backward, so the backward
would then read host weights (wrong device on a GPU). Here each onload installs new device Parameter
objects and the offload puts the host ones back; a device copy lives exactly as long as something needs it.
With gradient checkpointing (required: `train.offload: blocks` turns it on) the forward keeps only block
inputs, so a block's device copy is freed after its forward, and the backward's recompute of a block onloads
it again and keeps it until the next block's recompute (the recompute stops early, so no forward hook ends
it; the last block recomputed is put back when the backward ends, and the first offloaded block is then
copied ahead for the next forward; the forward's last block is copied again ahead of its recompute). The next block (in the direction of
execution: up in the forward, down in the backward's recomputes, told apart by whether autograd's backward
is running) is copied ahead on a side CUDA stream.

Only frozen parameters move: LoRA weights (trainable, owned by the optimizer) stay on the device. The first
`keep` blocks stay on the device whole. On a CPU (storage = compute = cpu) `always_copy` makes every onload
a real copy, so the mechanics run and are tested without a GPU.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch import nn

from models.quantize import is_nf4, nf4_map, plain_tensors_nf4


def pinned(t: torch.Tensor, pin=lambda x: x.pin_memory()) -> torch.Tensor:
    """A page-locked copy of a host tensor. A tensor subclass (torchao's int8 / fp8 weights) implements no pin
    op of its own: its inner tensors (codes, scales) are pinned and the subclass rebuilt around them."""
    if is_nf4(t):  # bitsandbytes' Params4bit: codes and statistics pinned, its own QuantState
        return nf4_map(t, pin)
    flatten = getattr(t, "__tensor_flatten__", None)
    if type(t) in (torch.Tensor, nn.Parameter) or flatten is None:
        return pin(t)
    names, meta = flatten()
    inner = {n: pinned(getattr(t, n), pin) for n in names}
    return type(t).__tensor_unflatten__(inner, meta, t.size(), t.stride())


def _in_backward() -> bool | None:
    """True inside autograd's backward (a checkpointed block's recompute): the next block is the one below.
    Comparing with the last block onloaded cannot tell a forward's first block after a backward (whose last
    recompute was that same block) from a backward's first recompute: it prefetched downwards, into
    nothing, at the start of every forward after the first."""
    task = getattr(torch._C, "_current_graph_task_id", None)  # private, present since torch 2.1
    return None if task is None else task() != -1


@dataclass
class _Block:
    index: int
    slots: list[tuple[nn.Module, str, nn.Parameter]]  # (module, parameter name, host parameter)
    handles: list = field(default_factory=list)


class BlockOffloader:
    def __init__(self, blocks: nn.ModuleList, device: torch.device | str, keep: int = 0, always_copy: bool = False):
        self.device = torch.device(device)
        self.always_copy = always_copy
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.pending: dict[int, list[torch.Tensor]] = {}
        self.last: int | None = None
        self.onloads = 0  # how many block onloads happened (tests, logs)
        self.unhidden = 0  # of those, how many were not copied ahead (a copy the compute waits for)
        # blocks whose installed device weights are still alive (a weak reference per onload, so whatever
        # holds them counts) and the most at once: 1 when each block's copy dies with its forward or backward
        # (the plan adds one prefetched block); a proof run reports it, also when it runs out of memory
        self.live: dict[int, int] = {}
        self.installed: set[int] = set()  # blocks whose device weights are in their modules now
        self.most_live = 0
        self._queued_for: int | None = None  # the backward whose end puts back the last block recomputed
        # (block onloaded, block copied ahead or None), the last few: which block is fetched when (tests)
        self.ahead: deque[tuple[int, int | None]] = deque(maxlen=4 * len(blocks) + 4)
        self.blocks: dict[int, _Block] = {}
        for i, block in enumerate(blocks):
            if i < keep:
                block.to(self.device)
                continue
            slots = []
            for module in block.modules():
                for name, p in list(module._parameters.items()):
                    if p is None:
                        continue
                    if p.requires_grad:  # LoRA: trained on the device
                        p.data = p.data.to(self.device)
                        continue
                    # (an NF4 weight's p.detach() would be its bare codes, without the statistics)
                    host = nf4_map(p, lambda t: t.detach().to("cpu")) if is_nf4(p) else p.detach().to("cpu")
                    if self.cuda:
                        host = pinned(host)  # async host->device copies need page-locked memory
                    hp = _as_parameter(host)
                    module._parameters[name] = hp
                    slots.append((module, name, hp))
            entry = _Block(i, slots)
            entry.handles.append(block.register_forward_pre_hook(self._pre_hook(i)))
            entry.handles.append(block.register_forward_hook(self._post_hook(i)))
            self.blocks[i] = entry

    # -------------------------------------------------------------------------------- copies

    def _copy(self, i: int) -> list[torch.Tensor]:
        out = []

        def move(t):
            return t.to(self.device, non_blocking=True, copy=self.always_copy)

        for _, _, host in self.blocks[i].slots:
            out.append(nf4_map(host, move) if is_nf4(host) else move(host.detach()))
        return out

    def _watch(self, i: int) -> None:
        """Count block i's installed device weights as alive until their Parameter object dies: a weak
        reference to it lasts while anything holds it (autograd's saved tensors keep the Python object too)."""
        if not self.blocks[i].slots:
            return
        mod, name, _ = self.blocks[i].slots[0]
        self.live[i] = self.live.get(i, 0) + 1
        weakref.finalize(mod._parameters[name], self._dropped, i)
        self.most_live = max(self.most_live, len(self.live))

    def _dropped(self, i: int) -> None:
        if self.live.get(i, 0) <= 1:
            self.live.pop(i, None)
        else:
            self.live[i] -= 1

    def _prefetch(self, i: int) -> None:
        if i not in self.blocks or i in self.pending:
            return
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.pending[i] = self._copy(i)
        else:
            self.pending[i] = self._copy(i)

    # -------------------------------------------------------------------------------- hooks

    def _pre_hook(self, i: int):
        def hook(module, args):
            tensors = self.pending.pop(i, None)
            if tensors is None:
                tensors = self._copy(i)
                self.unhidden += 1
            elif self.stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
                for t in tensors:  # freed on the compute stream's schedule, not the copy stream's
                    for plain in _plain_tensors(t):
                        plain.record_stream(torch.cuda.current_stream(self.device))
            # A checkpointed block's recompute stops early (torch.utils.checkpoint's default): its forward hook
            # never runs, so its device weights stayed installed until the next step's forward, all blocks' at
            # once by the backward's end (H200, int8 at a 24 GiB cap: 22.7 GiB where 10.3 were planned). The
            # backward recomputes block i after block i + 1's backward, so any other block still installed is
            # put back here; autograd keeps what it still holds, so nothing it uses is taken away.
            for j in [j for j in self.installed if j != i]:
                self._put_back(j)
            for (mod, name, _), t in zip(self.blocks[i].slots, tensors):
                mod._parameters[name] = _as_parameter(t)
            self.installed.add(i)
            self._watch(i)
            self.onloads += 1
            backward = _in_backward()
            if backward:
                self._put_back_at_end_of_backward()
            elif backward is None:  # no way to ask autograd: guess from the last block onloaded
                backward = self.last is not None and i <= self.last
            step = -1 if backward else 1
            self.last = i
            ahead = i + step if i + step in self.blocks else None
            if ahead is None and not backward and torch.is_grad_enabled():
                ahead = i  # the backward's first recompute is this block again: copied ahead while it runs
            self.ahead.append((i, ahead))
            if ahead is not None:
                self._prefetch(ahead)
        return hook

    def _post_hook(self, i: int):
        def hook(module, args, output):
            self._put_back(i)
        return hook

    def _put_back_at_end_of_backward(self) -> None:
        """Put back whatever is still installed once this backward is done: the last block recomputed would
        otherwise hold its device weights through the optimizer step and the data wait, until the next forward.
        Autograd's end-of-backward callback (what DDP and FSDP use too) runs once per backward, so it is queued
        once per graph task."""
        task = torch._C._current_graph_task_id()
        if task == self._queued_for:
            return
        self._queued_for = task
        torch.autograd.Variable._execution_engine.queue_callback(self._put_back_all)

    def _put_back_all(self) -> None:
        for j in list(self.installed):
            self._put_back(j)
        # the next forward starts at the first offloaded block: copied now, it overlaps the optimizer step
        # (within the plan's one block copied ahead) instead of being waited for
        if self.blocks:
            self._prefetch(min(self.blocks))

    def _put_back(self, i: int) -> None:
        for mod, name, host in self.blocks[i].slots:
            mod._parameters[name] = host  # autograd still holds the device copy if it needs it
        self.installed.discard(i)

    def remove(self) -> None:
        for entry in self.blocks.values():
            for h in entry.handles:
                h.remove()
        self.pending.clear()


def _plain_tensors(t: torch.Tensor):
    """The plain tensors holding `t`'s memory: torchao's quantised weights are wrapper subclasses whose
    dispatch has no record_stream (measured on the H200: NotImplementedError), their inner tensors do."""
    if is_nf4(t):
        yield from plain_tensors_nf4(t)
    elif is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _plain_tensors(getattr(t, name))
    else:
        yield t


def _as_parameter(t: torch.Tensor) -> nn.Parameter:
    """A frozen Parameter around `t`; an NF4 Params4bit is one already (re-wrapping drops its QuantState)."""
    return t if is_nf4(t) else nn.Parameter(t, requires_grad=False)


def offload_blocks(transformer, device: torch.device | str, keep: int, always_copy: bool | None = None) -> BlockOffloader:
    """Put everything but the offloaded blocks' frozen weights on `device`; hook the offloaded blocks."""
    device = torch.device(device)
    blocks = transformer.transformer_blocks
    for name, child in transformer.named_children():
        if name != "transformer_blocks":
            child.to(device)
    if always_copy is None:
        always_copy = device.type == "cpu"
    offloader = BlockOffloader(blocks, device, keep=keep, always_copy=always_copy)
    transformer._block_offloader = offloader  # keeps the hooks' owner alive with the model
    return offloader
