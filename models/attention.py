"""Attention kernels for padded mixed-resolution batches: which backend `MaskedJointAttnProcessor` uses.

A mixed batch carries a boolean key mask over the joint [text | image] sequence, with holes: text padding sits
between a sample's valid text and its image tokens. What each backend needs:

- diffusers' mask-taking backends (`native` SDPA, `_native_math`, `_native_efficient`, `_native_cudnn`,
  `flex`) take the mask as it is; `xformers` takes it as [B, S] (its 4-D form would be read as an additive 1/0
  bias there, not as a mask);
- diffusers' varlen backends (`flash_varlen`, `_flash_varlen_3`, `sage_varlen`) read the mask as a per-sample
  key *count* and take the first that many keys, so keys and values are first reordered per sample, valid
  ones first (`keys_first`; attention does not depend on key order, and RoPE is already applied);
- `packed` (ours, padding-free): the valid tokens of all samples packed into one sequence with per-sample
  boundaries, padded queries and keys skipped entirely; on CUDA PyTorch's own `varlen_attn` (flash / cuDNN,
  bf16/fp16, no extra package), on the CPU a per-sample SDPA loop (the same layout, to prove it exact).
  Padded query positions get 0 instead of an average of valid values; no valid token ever reads them.
  Its layout (valid-token indices, cumulative lengths, longest length) is a `JointLayout` that
  `multires_forward` builds once per forward and passes to every block: nothing inside a block syncs with the
  host, so 60 blocks and their checkpoint recomputes cost one sync, and compiled blocks have no graph break.
- `flash`, `_native_flash`, `sage`, ...: take no mask, refused (they would attend to padding).

Default (`resolve(None, ...)`): on CUDA `packed` for bf16/fp16 models when `varlen_attn` exists and a one-off
check on the device matches native SDPA, else `native`; on the CPU `native`. The choice and its reason (the
probe's error and its exception text when it failed) are printed once per process and kept on the model
(`attention_record`), so a run records which kernel it used and why: never a silent fallback.

Under a launcher (several ranks of one run) every rank probes its own device, then all ranks take one decision
together (`agree`): the most preferred backend every rank can run (`PREFERENCE`), so one DDP model never runs
different kernels (different numerics) on different ranks, nor fails later on one rank alone. The record then
also holds each rank's own probe and pick (`ranks`), and the reason names the ranks that held the choice down.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from torch import Tensor

from schemas.errors import UserError

MASK_BACKENDS = {"native", "_native_math", "_native_efficient", "_native_cudnn", "flex", "xformers"}
PREFIX_MASK_BACKENDS = {"flash_varlen", "_flash_varlen_3", "sage_varlen", "flash_varlen_hub", "_flash_3_varlen_hub"}
PACKED = "packed"
BACKENDS = sorted(MASK_BACKENDS | PREFIX_MASK_BACKENDS | {PACKED})


def check_name(name: str | None, key: str) -> None:
    if name is not None and name not in BACKENDS:
        raise UserError(
            f"{key} {name!r} is not an attention backend that honours the padding mask; use one of "
            f"{', '.join(BACKENDS)} (or null for the default)"
        )


def check_qwen21_name(name: str | None, key: str) -> None:
    """A backend named for a Qwen-Image-2.1 model: native or none (`use_attention_backend` once it loaded;
    `pipeline run all` before its first stage, from the model folder's variant)."""
    if name not in (None, "native"):
        raise UserError(f"{key} {name!r}: Qwen-Image-2.1's padded batches run one dense block-causal mask through "
                        f"native SDPA, the only kernel they take; set {key}: null (or native)")


@dataclass(frozen=True)
class Choice:
    backend: str
    reason: str
    probe: dict | None = None  # the packed probe's result on this device: ok, max_rel_err, error
    ranks: list[dict] | None = None  # several ranks: each rank's own {rank, backend, reason, probe} (`agree`)


_probes: dict[tuple, dict] = {}  # (device, dtype) -> probe result: one probe per process and device
_announced: set[tuple] = set()


def choose(name: str | None, device: torch.device, dtype: torch.dtype, key: str = "attention_backend") -> Choice:
    """The configured backend, or the default for this device and dtype, with the reason (module docstring)."""
    device = torch.device(device)
    if name is not None:
        return Choice(name, f"configured ({key})")
    if device.type != "cuda":
        return Choice("native", f"default on {device.type}: native SDPA with the padding mask (packed is for CUDA)")
    if dtype not in (torch.bfloat16, torch.float16):
        return Choice("native", f"default for {str(dtype).replace('torch.', '')} on CUDA: varlen kernels take bf16/fp16 only")
    probe = _probes.get((str(device), dtype))
    if probe is None:
        probe = _probes[(str(device), dtype)] = probe_packed(device, dtype)
    if probe["ok"]:
        return Choice(PACKED, f"default on CUDA: the packed probe matched native SDPA (max rel err {probe['max_rel_err']:.1e})", probe)
    why = probe["error"] or f"max rel err {probe['max_rel_err']:.1e} over the 2e-2 tolerance"
    return Choice("native", f"packed probe failed, falling back to native SDPA: {why}", probe)


def resolve(name: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """The configured backend, or the default for this device and dtype (see the module docstring)."""
    return choose(name, device, dtype).backend


# The default's backends, most preferred first. A rank's own pick is the first it can run, and it can run every
# later one (native is the processor's own path, which runs anywhere): so the least preferred of the ranks' picks
# is the best backend every rank can run.
PREFERENCE = (PACKED, "native")


def agree(choice: Choice, world: int, key: str) -> Choice:
    """All ranks' one decision from every rank's own `choice` (a collective: every rank calls it;
    models/agreement.py). The same backend everywhere: kept, rank 0's reason. Different picks of the default: the
    least preferred of them, with the reason naming the ranks that picked it and why. Different backends outside
    the default's (configured differently per rank): the same `UserError` on every rank. One process: `choice` as
    it is."""
    if world <= 1:
        return choice
    from models.agreement import agree_on

    mine = {"backend": choice.backend, "reason": choice.reason, "probe": choice.probe}
    agreed, reason, ranks = agree_on(world, mine, "backend", PREFERENCE, key, "backend")
    return replace(choice, backend=agreed["backend"], reason=reason, ranks=ranks)


def announce(choice: Choice, key: str) -> None:
    """Print the choice once per process (per key and choice): the user sees which kernel runs and why."""
    if (key, choice.backend, choice.reason) in _announced:
        return
    _announced.add((key, choice.backend, choice.reason))
    import os

    from tqdm.auto import tqdm

    rank = os.environ.get("RANK", "0")  # a launcher's (torchrun, accelerate)
    if rank != "0" and (choice.ranks is not None or (choice.probe or {}).get("ok", True)):
        # alike devices decide alike: 8 ranks printed 8 copies; an agreed choice's reason on rank 0 names the odd
        # rank(s); a choice not agreed on, whose probe failed, is still said by its rank (its GPU may be the odd one)
        return
    tqdm.write(f"{'' if rank == '0' else f'rank {rank}: '}{key}: {choice.backend} ({choice.reason})", file=sys.stderr)


def attention_record(transformer) -> dict | None:
    """The backend `use_attention_backend` set on this model and why (for run records); with several ranks, each
    rank's own probe and pick under `ranks`."""
    choice = getattr(transformer, "_attention_choice", None)
    if choice is None:
        return None
    record = asdict(choice)
    if record["ranks"] is None:  # one process: the record as before
        del record["ranks"]
    return record


def report_choice(device: torch.device, dtype: torch.dtype) -> dict:
    """The default choice on this device, as a record (bench/gpu/proof.py's environment)."""
    return asdict(choose(None, torch.device(device), dtype))


def set_backend(transformer, name: str) -> None:
    """Every multires processor of the model uses `name` for masked batches; unmasked (same-size) batches keep
    diffusers' default kernel choice (native SDPA picks flash itself when there is no mask)."""
    from models.multires import MaskedJointAttnProcessor, _unwrap

    # `native` is the processor's own unchanged path (diffusers' default backend, stock code for stock batches).
    multires = None if name == "native" else name
    for proc in _unwrap(transformer).attn_processors.values():
        if isinstance(proc, MaskedJointAttnProcessor):
            proc._multires_backend = multires
            proc._attention_backend = None if multires in (None, PACKED) else multires


def agreed_backend(name: str | None, key: str, device: torch.device, dtype: torch.dtype, world: int = 1,
                   qwen21: bool = False) -> str:
    """The backend `use_attention_backend` will set for `name` (before any model is loaded): what a run records
    and its reuse compares, so that an unset name and the name it resolves to are one run. With several ranks
    (`world`) a collective, as `use_attention_backend`. `qwen21`: the model is Qwen-Image-2.1 (native only)."""
    return agreed_choice(name, key, device, dtype, world, qwen21).backend


def agreed_choice(name: str | None, key: str, device: torch.device, dtype: torch.dtype, world: int = 1,
                  qwen21: bool = False) -> Choice:
    """`agreed_backend` with its reason (and probe): what `use_attention_backend(..., choice=)` then sets."""
    check_name(name, key)
    if qwen21:  # another name is refused when the model loads (`use_attention_backend`)
        choice = Choice(name or "native", "Qwen-Image-2.1: its dense block-causal mask through native SDPA")
    else:
        choice = choose(name, torch.device(device), dtype, key)
    return agree(choice, world, key)  # on every path: ranks that took different ones meet in the same collective


def use_attention_backend(transformer, name: str | None, key: str, device: torch.device, dtype: torch.dtype,
                          world: int = 1, choice: Choice | None = None) -> str:
    """Check the configured name, resolve the default, set it on the model; returns the backend in use. With
    several ranks (`world`), a collective: every rank calls it, and all take the same backend (`agree`).
    `choice`: the ranks' decision made already (`agreed_choice`, of `name`): set as it is, nothing decided again
    (every rank passes one, or none)."""
    from models.qwen21_flow import is_qwen21

    check_name(name, key)
    if is_qwen21(transformer):  # its processor (models/qwen21_multires.py) takes no backend: never record one it ignores
        check_qwen21_name(name, key)
        choice = agree(Choice("native", "Qwen-Image-2.1: its dense block-causal mask through native SDPA"), world, key)
    else:
        if choice is None:
            choice = agree(choose(name, torch.device(device), dtype, key), world, key)
        set_backend(transformer, choice.backend)
    transformer._attention_choice = choice
    announce(choice, key)
    return choice.backend


def attend(query: Tensor, key: Tensor, value: Tensor, mask: "JointLayout | Tensor | None", backend: str | None,
           parallel_config=None) -> Tensor:
    """Joint attention, q/k/v [B, S, H, D]; mask: the forward's `JointLayout`, or a [B, 1, 1, S] bool key mask,
    or None. Returns [B, S, H, D]."""
    if backend == PACKED and mask is not None:
        return packed_attention(query, key, value, mask)
    if isinstance(mask, JointLayout):
        mask = mask.mask
    if backend == PACKED:  # nothing to skip: SDPA without a mask (it picks flash itself)
        backend = "native"
    if backend in PREFIX_MASK_BACKENDS and mask is not None:
        key, value, mask = keys_first(key, value, mask[:, 0, 0, :])
        mask = mask[:, None, None, :]
    elif backend == "xformers" and mask is not None:
        # diffusers' xformers backend turns a 2-D bool key mask into an additive one (-inf on padding) but
        # casts a 4-D bool mask as it is (True -> 1.0, False -> 0.0, added to the scores): padding attended
        mask = mask[:, 0, 0, :]
    return dispatch_attention_fn(query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False,
                                 backend=backend, parallel_config=parallel_config)


def keys_first(key: Tensor, value: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per sample, valid keys/values moved to the front (stable); mask [B, S] -> the matching prefix mask."""
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # valid (0) before padding (1)
    idx = order[:, :, None, None].expand_as(key)
    prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < mask.sum(dim=1, keepdim=True)
    return key.gather(1, idx), value.gather(1, idx), prefix


@dataclass(frozen=True)
class JointLayout:
    """Where the valid tokens of a padded joint [text | image] batch are. Built once per transformer forward,
    outside the checkpointed (and compiled) blocks, and handed to every block's attention through
    `attention_kwargs`: the blocks read it and never derive it from a tensor, so they hold no host sync, no
    data-dependent Python int (a graph break under torch.compile) and no cache that could answer differently
    in the forward and in the checkpoint recompute."""

    mask: Tensor  # [B, 1, 1, S_txt + S_img] bool key mask (the mask-taking backends)
    index: Tensor | None = None  # packed: [N] int64 flat positions of the valid tokens in [B * S]
    cu_seqlens: Tensor | None = None  # packed: [B + 1] int32 cumulative valid lengths
    max_len: int = 0  # packed: the longest sample's valid length (varlen kernels take it as an int)
    bounds: tuple[int, ...] = ()  # packed: cu_seqlens on the host (the CPU reference loop's segments)


def joint_key_mask(txt_mask: Tensor | None, img_mask: Tensor | None, batch: int, seq_txt: int, seq_img: int,
                   device: torch.device) -> Tensor:
    """[B, 1, 1, S_txt + S_img] bool key mask over the joint [text | image] sequence."""
    txt = txt_mask.to(torch.bool) if txt_mask is not None else torch.ones((batch, seq_txt), dtype=torch.bool, device=device)
    img = img_mask.to(torch.bool) if img_mask is not None else torch.ones((batch, seq_img), dtype=torch.bool, device=device)
    return torch.cat([txt, img], dim=1)[:, None, None, :]


def joint_layout(txt_mask: Tensor | None, img_mask: Tensor | None, batch: int, seq_txt: int, seq_img: int,
                 device: torch.device, packed: bool) -> JointLayout:
    """The layout of one forward (see `JointLayout`); with `packed`, also the packed indices and lengths."""
    mask = joint_key_mask(txt_mask, img_mask, batch, seq_txt, seq_img, device)
    return packed_layout(mask) if packed else JointLayout(mask)


def packed_layout(mask: Tensor) -> JointLayout:
    """Flat indices of the valid tokens, cumulative lengths, longest length. mask [B, S] or [B, 1, 1, S] bool.

    Computed from one host copy of the mask (B x S bools): the lengths are needed on the host anyway (varlen
    kernels take the longest as an int), so this is the forward's one sync for attention, and the index and
    lengths go to the device once, for all blocks."""
    flat = mask if mask.ndim == 2 else mask[:, 0, 0, :]
    host = flat.to("cpu", torch.bool)
    lens = host.sum(dim=1, dtype=torch.int32)
    cu = torch.zeros(host.shape[0] + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, dim=0)
    index = host.flatten().nonzero().squeeze(1)
    joint = mask if mask.ndim == 4 else mask[:, None, None, :]
    return JointLayout(joint, index.to(mask.device), cu.to(mask.device), int(lens.max()), tuple(cu.tolist()))


def packed_attention(query: Tensor, key: Tensor, value: Tensor, layout: JointLayout | Tensor | None) -> Tensor:
    """Padding-free attention: the valid tokens of all samples as one sequence with per-sample boundaries.
    layout: a `JointLayout` with the packed fields (the per-forward one), or a [B, S] / [B, 1, 1, S] bool mask
    of valid tokens (the same positions for queries and keys; its layout is built here, one host sync)."""
    b, s, h, d = query.shape
    if layout is None:
        layout = torch.ones((b, s), dtype=torch.bool, device=query.device)
    if not isinstance(layout, JointLayout) or layout.index is None:
        layout = packed_layout(layout if isinstance(layout, Tensor) else layout.mask)
    idx = layout.index
    q, k, v = (x.flatten(0, 1).index_select(0, idx) for x in (query, key, value))
    if query.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(q, k, v, layout.cu_seqlens, layout.cu_seqlens, layout.max_len, layout.max_len)
    else:  # reference kernel on the CPU: the same packed layout, one SDPA per segment
        bounds = layout.bounds
        out = torch.cat([
            torch.nn.functional.scaled_dot_product_attention(
                *(x[bounds[i] : bounds[i + 1]].transpose(0, 1)[None] for x in (q, k, v))
            )[0].transpose(0, 1)
            for i in range(b)
        ])
    full = out.new_zeros((b * s, h, d)).index_copy(0, idx, out)
    return full.view(b, s, h, d)


PROBE_HEAD_DIM = 128  # attention_head_dim of the published Qwen-Image-Edit models (models/published)


def probe_packed(device: torch.device, dtype: torch.dtype) -> dict:
    """A one-off check on the device: packed attention on a small padded batch equals masked native SDPA.
    Returns {ok, max_rel_err, error, head_dim}: error is the exception (type and text) when the kernel did not
    run. At the models' head dim (128: Qwen-Image and 2.1), since a kernel's support can depend on it."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401

        g = torch.Generator(device).manual_seed(0)
        q, k, v = (torch.randn(2, 300, 4, PROBE_HEAD_DIM, device=device, dtype=dtype, generator=g) for _ in range(3))
        mask = torch.ones(2, 300, dtype=torch.bool, device=device)
        mask[0, 20:40] = False
        mask[1, 250:] = False
        ours = packed_attention(q, k, v, mask)
        ref = dispatch_attention_fn(q, k, v, attn_mask=mask[:, None, None, :], backend="native")
        err = ((ours - ref).float()[mask].abs().max() / ref.float()[mask].abs().max()).item()
        return {"ok": err <= 2e-2, "max_rel_err": err, "error": None, "head_dim": PROBE_HEAD_DIM}
    except Exception as e:  # no varlen kernel for this GPU / build: native, and the reason is reported
        text = " ".join(str(e).split())  # one line (CUDA errors span several)
        return {"ok": False, "max_rel_err": None, "error": f"{type(e).__name__}: {text[:300]}", "head_dim": PROBE_HEAD_DIM}
