"""What autograd keeps for the backward of one transformer block, per family (not a test module itself: used by
tests/models/test_memory_plan_activations.py and bench/block_activations.py).

A model of a family's real block shape at a chosen width is built as the trainer builds it (stages/train/build.py
`setup_transformer`: bf16 frozen base, the family's attention processor, the default backend, the trainer's LoRA on
`train.lora.target_modules` in float32) and runs one sample the way training does (Edit: `multires_forward`; 2.1:
`qwen21_forward`) under bf16 autocast. The saved tensors are caught with `torch.autograd.graph.saved_tensors_hooks`,
counted once per storage (a view saved twice, or by two ops, holds one storage), the frozen and LoRA weights left
out; a storage is charged to the block that first saves it. The measured block is the third of three: before it, both
streams' inputs require grad as in the middle of the stack (an Edit block's text stream only after a block whose
attention mixed the LoRA'd image stream in) and the tensors every block shares (RoPE tables, 2.1's mask) are
charged to the blocks that first saved them."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# A real sample's split of the sequence, as fractions: Edit: the target, one control of its size, the prompt
# (with the VLM's tokens); 2.1: the prompt, one reference of the target's size, the target.
TEXT_FRACTION = 0.2


@dataclass
class BlockSaved:
    per_token: int  # bytes of storages that grow with the tokens (the plan's per-token term)
    square: int  # bytes of [.., S, S] storages (2.1's attention mask copies: qwen21_mask_bytes' term)
    tokens: int
    width: int

    @property
    def units(self) -> float:
        """Per token per block width, in bf16 elements (the unit of ActivationUnits.per_token_block)."""
        return self.per_token / (self.tokens * self.width * 2)


def lora_model(family: str, width_heads: int, head_dim: int = 128, blocks: int = 3, **config):
    """A bf16 transformer of `family` ("edit" / "qwen-image-2.1") with `width_heads` heads of `head_dim`, the
    trainer's processor and LoRA. The family's other config values are its published ones unless given."""
    from diffusers import QwenImage21Transformer2DModel, QwenImageTransformer2DModel

    from models.attention import use_attention_backend
    from models.full_width import FULL_TRANSFORMER, _default_dtype
    from models.lora import add_lora
    from schemas.config import LoraConfig

    with _default_dtype(torch.bfloat16):
        torch.manual_seed(0)
        if family == "qwen-image-2.1":
            from models.qwen21_multires import install_qwen21

            model = QwenImage21Transformer2DModel(num_layers=blocks, num_attention_heads=width_heads,
                                                  attention_head_dim=head_dim, **config)
            install_qwen21(model)
        else:
            from models.multires import install_multires

            model = QwenImageTransformer2DModel(**{**FULL_TRANSFORMER, "num_layers": blocks,
                                                   "num_attention_heads": width_heads,
                                                   "attention_head_dim": head_dim, **config})
            install_multires(model)
    use_attention_backend(model, None, "train.attention_backend", torch.device("cpu"), torch.bfloat16, 1)
    add_lora(model, LoraConfig())
    model.train()
    return model


def run_sample(model, tokens: int) -> tuple[int, torch.Tensor]:
    """One training forward of a sample of about `tokens` (image/text split as TEXT_FRACTION), under bf16
    autocast; returns its sequence length (`tokens` rounded to the families' 2x2 latent groups) and the output."""
    from models.qwen21_flow import is_qwen21

    g = torch.Generator().manual_seed(1)
    text = max(4, int(tokens * TEXT_FRACTION))
    image = (tokens - text) // 2 // 4 * 4  # each of target and reference / control, whole 2x2 groups
    hw = (2, image // 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if is_qwen21(model):
            from models.qwen21_multires import Qwen21Sample, build_batch, qwen21_forward

            c, d = model.config.in_channels, model.config.context_in_dim
            mask = torch.tensor([False] * (text - 2) + [True] * (image // 4) + [False] * 2)
            sample = Qwen21Sample(prompt_embeds=torch.randn(len(mask), d, generator=g), slot_mask=mask,
                                  references=[torch.randn(c, 1, *hw, generator=g)],
                                  target=torch.randn(image, c, generator=g), target_hw=hw)
            out = qwen21_forward(model, build_batch([sample]), torch.tensor([0.5]))
        else:
            from models.multires import build_batch, multires_forward

            c4, d = model.config.in_channels, model.config.joint_attention_dim
            latent_hw = (2 * hw[0], 2 * hw[1])  # packed: 2x2 latent pixels per token
            control = torch.randn(c4 // 4, 1, *latent_hw, generator=g)
            batch = build_batch([torch.randn(image, c4, generator=g)], [[control]], [torch.randn(text, d, generator=g)],
                                [[(1, *hw), (1, *hw)]])
            out = multires_forward(model, batch, torch.tensor([0.5]))
    return text + 2 * image, out


def block_saved(model, tokens: int, block: int = 2) -> BlockSaved:
    """The storages `block` (the last of three, the first two having made its inputs as in the middle of the stack)
    saves for the backward of `run_sample(model, tokens)`."""
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    first_saved_by: dict[int, tuple[int | None, torch.Tensor]] = {}
    current: list[int | None] = [None]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights and ptr not in first_saved_by:
            first_saved_by[ptr] = (current[0], t)  # held: no saved storage is freed and its address reused
        return t

    def enter(i):
        return lambda *_: current.__setitem__(0, i)

    hooks = []
    for i, b in enumerate(model.transformer_blocks):
        hooks += [b.register_forward_pre_hook(enter(i)), b.register_forward_hook(enter(None))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            seq, _ = run_sample(model, tokens)
    finally:
        for h in hooks:
            h.remove()
    mine = [t for i, t in first_saved_by.values() if i == block]
    square = [t for t in mine if t.ndim >= 2 and t.shape[-2:] == (seq, seq)]
    ids = {id(t) for t in square}
    nbytes = lambda ts: sum(t.untyped_storage().nbytes() for t in ts)  # noqa: E731
    width = model.config.num_attention_heads * model.config.attention_head_dim
    return BlockSaved(nbytes(t for t in mine if id(t) not in ids), nbytes(square), seq, width)


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages the ops made that are still alive (each counted once, dropped when freed)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}

    def _freed(self, ptr: int, n: int) -> None:
        self.sizes.pop(ptr, None)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self.sizes:
                    self.sizes[ptr] = n = storage.nbytes()
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, ptr, n)
        return out


def block_backward_peak(model, tokens: int, block: int = 2) -> float:
    """How far one step's live memory rises above what it held when the backward reached `block` (its saved
    tensors and its output's gradient) until it leaves it, per token per width in bf16 elements: the block's part
    of the plan's backward working set. `block` is the last of three, the first the backward runs."""
    live, marks = _LiveBytes(), {}

    def reached(_):
        marks["start"] = live.peak = live.live

    def left(_):
        marks["peak"] = live.peak

    def watch(module, args, kwargs, out):  # an Edit block returns (text, image): the image stream's gradient
        (out[-1] if isinstance(out, tuple) else out).register_hook(reached)
        kwargs.get("hidden_states", args[0] if args else None).register_hook(left)

    hook = model.transformer_blocks[block].register_forward_hook(watch, with_kwargs=True)
    try:
        with live:
            seq, out = run_sample(model, tokens)
            out.float().square().mean().backward()
    finally:
        hook.remove()
        for p in model.parameters():
            p.grad = None
    width = model.config.num_attention_heads * model.config.attention_head_dim
    return (marks["peak"] - marks["start"]) / (seq * width * 2)
