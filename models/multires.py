"""Mixed-resolution batches on an unmodified diffusers `QwenImageTransformer2DModel` (DESIGN §5).

Stock diffusers computes RoPE from the first sample's `img_shapes` for the whole batch and its attention
processor refuses an image mask. `install_multires` fixes both on one model instance, without forking
diffusers and without touching parameters:

- `pos_embed` becomes `PerSampleRope`: image frequencies per sample from its own shapes, text frequencies per
  sample (they start after that sample's largest image), and a neutral rotation (1+0j) at padded positions;
- every block's attention gets `MaskedJointAttnProcessor`, which takes a boolean image key mask through
  `attention_kwargs` and joins it with the text mask, so no token attends to padding.

Samples are packed as [target tokens | control tokens | zero padding] along the image sequence. `img_shapes`
for a padded sample carries a `PadShape(1, 1, pad)` marker entry: the model's `zero_cond_t` bookkeeping
(`modulate_index`) then stays rectangular (padding counts as condition tokens, masked anyway), and
`PerSampleRope` recognises and skips it. A batch whose samples all have the same shapes takes the stock code
path unchanged, so it is bit-identical to the stock processor.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    QwenEmbedRope,
    apply_rotary_emb_qwen,
)
from torch import Tensor, nn

from models.attention import PACKED, JointLayout, attend, joint_key_mask, joint_layout

Shape = tuple[int, int, int]


class PadShape(tuple):
    """`(1, 1, pad)`: marks `pad` padding tokens at the end of a sample's image sequence (not an image)."""

    def __new__(cls, pad: int) -> "PadShape":
        return super().__new__(cls, (1, 1, int(pad)))


class SampleShapes(list):
    """One sample's img_shapes (target, controls, optional PadShape) plus its valid text length.

    A list subclass so the model's own `sample[0]` / `sample[1:]` bookkeeping reads it like a plain list.
    """

    def __init__(self, shapes: list, text_len: int | None = None):
        super().__init__(shapes)
        self.text_len = text_len


# ---------------------------------------------------------------------------------------------- RoPE


class PerSampleRope(nn.Module):
    """Drop-in for `QwenEmbedRope` that returns per-sample frequencies ([B, S, D/2]) for a multires batch.

    Called the stock way (plain `img_shapes`, e.g. by a diffusers pipeline after install) it defers to the
    wrapped stock module, so inference is unchanged. Holds no parameters or buffers (like the stock one).
    """

    def __init__(self, stock: QwenEmbedRope):
        super().__init__()
        self.stock = stock

    def forward(self, video_fhw, device: torch.device | None = None, max_txt_seq_len: int | Tensor | None = None):
        if not (isinstance(video_fhw, list) and video_fhw and isinstance(video_fhw[0], SampleShapes)):
            return self.stock(video_fhw, device=device, max_txt_seq_len=max_txt_seq_len)
        if max_txt_seq_len is None:
            raise ValueError("`max_txt_seq_len` must be provided.")
        txt_len = int(max_txt_seq_len)
        pos_freqs, _ = self.stock._get_device_freqs(device)
        neutral = torch.ones((), dtype=pos_freqs.dtype, device=pos_freqs.device)
        img_rows, txt_rows = [], []
        for sample in video_fhw:
            parts, max_vid_index, idx = [], 0, 0
            for fhw in sample:
                if isinstance(fhw, PadShape):
                    parts.append(neutral.expand(prod(fhw), pos_freqs.shape[1]))
                    continue
                frame, height, width = fhw
                # Same frequencies, same image index and same text offset as stock QwenEmbedRope (scale_rope).
                parts.append(self.stock._compute_video_freqs(frame, height, width, idx, device))
                idx += 1
                if self.stock.scale_rope:
                    max_vid_index = max(height // 2, width // 2, max_vid_index)
                else:
                    max_vid_index = max(height, width, max_vid_index)
            img_rows.append(torch.cat(parts, dim=0))
            txt = pos_freqs[max_vid_index : max_vid_index + txt_len]
            if sample.text_len is not None and sample.text_len < txt_len:
                txt = torch.cat([txt[: sample.text_len], neutral.expand(txt_len - sample.text_len, txt.shape[1])])
            txt_rows.append(txt)
        return torch.stack(img_rows), torch.stack(txt_rows)


def text_positions_left(img_shapes, scale_rope: bool = True) -> int:
    """How many text tokens the stock RoPE table holds next to these images: diffusers' `QwenEmbedRope` builds a
    fixed table (4096 positions) and starts the text at the largest image extent (as `PerSampleRope` does); a
    longer text has no positions and the transformer fails. Read from an instance, so the number follows diffusers."""
    extent = 0
    for _, height, width in img_shapes or ():
        extent = max(extent, max(height // 2, width // 2) if scale_rope else max(height, width))
    return _rope_table_positions() - extent


@lru_cache(maxsize=1)
def _rope_table_positions() -> int:
    return int(QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True).pos_freqs.shape[0])


def _apply_rope(x: Tensor, freqs: Tensor) -> Tensor:
    """x [B, S, H, D]; freqs [S, D/2] (stock, shared) or [B, S, D/2] (per sample)."""
    if freqs.ndim == 2:
        return apply_rotary_emb_qwen(x, freqs, use_real=False)
    x_c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_c * freqs.unsqueeze(2)).flatten(3).type_as(x)


# ---------------------------------------------------------------------------------------------- attention


# What MaskedJointAttnProcessor.__call__ was derived from: diffusers' QwenDoubleStreamAttnProcessor2_0.__call__,
# as a hash of its syntax tree (comments and docstrings do not count). When the installed diffusers' processor
# differs, our copy may have drifted from it: install_multires warns and tests/models/test_multires.py fails,
# naming what to re-derive. The copy stays (rather than patching the stock one's module globals) so that
# per-sample RoPE and the packed kernel trace cleanly under torch.compile.
STOCK_PROCESSOR_AST = "99bdd15622c801ea0002bdba3ee0562fd693fb1a718a90261e8cd1af3705ce81"


def stock_processor_ast() -> str:
    """sha256 of the installed stock processor's `__call__`, as its syntax tree unparsed without docstrings."""
    import ast
    import hashlib
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(QwenDoubleStreamAttnProcessor2_0.__call__)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.unparse(tree).encode()).hexdigest()  # normalised source: layout-independent


class MaskedJointAttnProcessor(QwenDoubleStreamAttnProcessor2_0):
    """Stock joint [text | image] attention plus an image key mask and per-sample RoPE.

    Without an image mask and with shared (2-D) RoPE it *is* the stock processor (delegates), so same-size
    batches are bit-identical. A subclass, so `set_attention_backend` and friends keep working.
    `_multires_backend` (set by `models.attention.set_backend`): the kernel for padded batches.

    What differs from the stock `__call__` (STOCK_PROCESSOR_AST), and only that: the joint key mask covers the
    image tokens too (`image_mask`, or the forward's `joint_layout`); RoPE may be per sample (`_apply_rope`);
    the attention goes to `_multires_backend` (`models.attention.attend`) when one is set.
    """

    _multires_backend: str | None = None

    def __call__(
        self,
        attn,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor = None,
        encoder_hidden_states_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
        image_mask: Tensor | None = None,
        joint_layout: JointLayout | None = None,
    ):
        per_sample_rope = image_rotary_emb is not None and image_rotary_emb[0].ndim == 3
        if image_mask is None and not per_sample_rope and (encoder_hidden_states_mask is None or self._multires_backend is None):
            return super().__call__(
                attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask, image_rotary_emb
            )
        if encoder_hidden_states is None:
            raise ValueError("MaskedJointAttnProcessor requires encoder_hidden_states (text stream)")
        if attention_mask is not None:
            raise ValueError("MaskedJointAttnProcessor builds its own mask: pass encoder_hidden_states_mask/image_mask")

        # differs: the mask covers [text | image] keys; one layout per forward (multires_forward: no per-block sync)
        batch, seq_img = hidden_states.shape[:2]
        seq_txt = encoder_hidden_states.shape[1]
        if joint_layout is not None:
            attention_mask = joint_layout if self._multires_backend is not None else joint_layout.mask
        elif image_mask is not None or encoder_hidden_states_mask is not None:
            attention_mask = joint_key_mask(encoder_hidden_states_mask, image_mask, batch, seq_txt, seq_img,
                                            hidden_states.device)

        # as stock: projections, heads, QK norms
        head_dim = attn.inner_dim // attn.heads
        img_query = attn.to_q(hidden_states).unflatten(-1, (-1, head_dim))
        img_key = attn.to_k(hidden_states).unflatten(-1, (-1, head_dim))
        img_value = attn.to_v(hidden_states).unflatten(-1, (-1, head_dim))
        txt_query = attn.add_q_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        txt_key = attn.add_k_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        txt_value = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        if attn.norm_q is not None:
            img_query = attn.norm_q(img_query)
        if attn.norm_k is not None:
            img_key = attn.norm_k(img_key)
        if attn.norm_added_q is not None:
            txt_query = attn.norm_added_q(txt_query)
        if attn.norm_added_k is not None:
            txt_key = attn.norm_added_k(txt_key)

        if image_rotary_emb is not None:  # differs: per-sample freqs allowed (stock's function for shared ones)
            img_freqs, txt_freqs = image_rotary_emb
            img_query, img_key = _apply_rope(img_query, img_freqs), _apply_rope(img_key, img_freqs)
            txt_query, txt_key = _apply_rope(txt_query, txt_freqs), _apply_rope(txt_key, txt_freqs)

        joint_query = torch.cat([txt_query, img_query], dim=1)
        joint_key = torch.cat([txt_key, img_key], dim=1)
        joint_value = torch.cat([txt_value, img_value], dim=1)
        if self._multires_backend is not None:  # differs: the padded-batch kernel (packed, or a masked SDPA)
            joint = attend(joint_query, joint_key, joint_value, attention_mask, self._multires_backend,
                           self._parallel_config)
        else:
            joint = dispatch_attention_fn(joint_query, joint_key, joint_value, attn_mask=attention_mask, dropout_p=0.0,
                                          is_causal=False, backend=self._attention_backend,
                                          parallel_config=self._parallel_config)
        joint = joint.flatten(2, 3).to(joint_query.dtype)

        # as stock: split, output projections
        img_out = attn.to_out[0](joint[:, seq_txt:, :].contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        txt_out = attn.to_add_out(joint[:, :seq_txt, :].contiguous())
        return img_out, txt_out


def install_multires(transformer) -> None:
    """Install per-sample RoPE and the masked processor on this model instance. Idempotent; no parameter change."""
    transformer = _unwrap(transformer)
    if not isinstance(transformer.pos_embed, (QwenEmbedRope, PerSampleRope)):
        raise ValueError(
            f"multires supports QwenEmbedRope only, this transformer has {type(transformer.pos_embed).__name__} "
            "(use_layer3d_rope models are not supported)"
        )
    if not isinstance(transformer.pos_embed, PerSampleRope):
        transformer.pos_embed = PerSampleRope(transformer.pos_embed)
    transformer.set_attn_processor(MaskedJointAttnProcessor())
    _warn_if_stock_processor_changed()


@lru_cache(maxsize=1)
def _warn_if_stock_processor_changed() -> None:
    if stock_processor_ast() != STOCK_PROCESSOR_AST:
        import logging

        import diffusers

        logging.getLogger(__name__).warning(
            "diffusers %s: QwenDoubleStreamAttnProcessor2_0.__call__ differs from the one MaskedJointAttnProcessor "
            "was derived from; padded batches may no longer match the stock model (tests/models/test_multires.py "
            "checks it; pin the tested diffusers version)", diffusers.__version__)


def _unwrap(model):
    """The transformer inside DDP / DataParallel (`.module`) or torch.compile (`._orig_mod`) wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None or not isinstance(inner, nn.Module):
            return model
        model = inner


def is_installed(transformer) -> bool:
    model = _unwrap(transformer)
    return isinstance(getattr(model, "pos_embed", None), PerSampleRope) and all(
        isinstance(p, MaskedJointAttnProcessor) for p in model.attn_processors.values()
    )


# ---------------------------------------------------------------------------------------------- packing


def pack_latents(latent: Tensor) -> Tensor:
    """[C, 1, h, w] or [C, h, w] -> [h/2 * w/2, 4C], token order and channel order of diffusers `_pack_latents`."""
    if latent.ndim == 4:
        if latent.shape[1] != 1:
            raise ValueError(f"expected one frame, got latent of shape {tuple(latent.shape)}")
        latent = latent[:, 0]
    c, h, w = latent.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height/width must be even (2x2 patches), got {h}x{w}")
    x = latent.reshape(c, h // 2, 2, w // 2, 2).permute(1, 3, 0, 2, 4)
    return x.reshape((h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: Tensor, h: int, w: int) -> Tensor:
    """Inverse of `pack_latents`: [h/2 * w/2, 4C] -> [C, 1, h, w] (h, w in latent pixels)."""
    n, c4 = tokens.shape
    if n != (h // 2) * (w // 2):
        raise ValueError(f"{n} tokens do not fill a {h}x{w} latent")
    x = tokens.reshape(h // 2, w // 2, c4 // 4, 2, 2).permute(2, 0, 3, 1, 4)
    return x.reshape(c4 // 4, 1, h, w)


@dataclass
class PackedBatch:
    hidden_states: Tensor  # [B, S_img, 4C]: each sample's target tokens, then its control tokens, zero padding
    encoder_hidden_states: Tensor  # [B, S_txt, D] zero-padded
    encoder_mask: Tensor  # [B, S_txt] bool
    image_mask: Tensor  # [B, S_img] bool, valid image tokens (target + controls)
    target_mask: Tensor  # [B, S_img] bool, target tokens only (the loss positions)
    img_shapes: list[list[Shape]]  # per sample, target first, then each control (patch units)

    @property
    def target_lens(self) -> list[int]:
        return [prod(s[0]) for s in self.img_shapes]

    @property
    def image_lens(self) -> list[int]:
        return [sum(prod(x) for x in s) for s in self.img_shapes]

    @property
    def text_lens(self) -> list[int]:
        return self.encoder_mask.sum(dim=1).tolist()

    def to(self, device, dtype: torch.dtype | None = None) -> "PackedBatch":
        return PackedBatch(
            hidden_states=self.hidden_states.to(device=device, dtype=dtype),
            encoder_hidden_states=self.encoder_hidden_states.to(device=device, dtype=dtype),
            encoder_mask=self.encoder_mask.to(device),
            image_mask=self.image_mask.to(device),
            target_mask=self.target_mask.to(device),
            img_shapes=self.img_shapes,
        )


def _pad_stack(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Stack [N_i, D] rows zero-padded to max N; returns (stacked, bool valid mask)."""
    longest = max(r.shape[0] for r in rows)
    out = rows[0].new_zeros((len(rows), longest, rows[0].shape[1]))
    mask = torch.zeros((len(rows), longest), dtype=torch.bool, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = True
    return out, mask


def build_batch(
    target_tokens: list[Tensor],
    control_latents: list[list[Tensor]],
    prompt_embeds: list[Tensor],
    img_shapes: list[list[Shape]],
) -> PackedBatch:
    """Pad per-sample packed targets + packed controls and text embeds into one batch.

    target_tokens[i]: [N_i, 4C] packed (already noised) target; control_latents[i]: list of [C, 1, h, w];
    prompt_embeds[i]: [L_i, D] valid tokens only. Everything takes the dtype of target_tokens[0].
    """
    if not (len(target_tokens) == len(control_latents) == len(prompt_embeds) == len(img_shapes)) or not target_tokens:
        raise ValueError("build_batch: target_tokens, control_latents, prompt_embeds and img_shapes must be equal-length, non-empty lists")
    dtype = target_tokens[0].dtype
    rows, target_lens = [], []
    for i, (tgt, controls, shapes) in enumerate(zip(target_tokens, control_latents, img_shapes)):
        parts = [tgt.to(dtype)] + [pack_latents(c).to(device=tgt.device, dtype=dtype) for c in controls]
        expected = [prod(s) for s in shapes]
        got = [p.shape[0] for p in parts]
        if expected != got:
            raise ValueError(f"sample {i}: img_shapes {shapes} give token counts {expected}, tensors have {got}")
        rows.append(torch.cat(parts, dim=0))
        target_lens.append(got[0])
    hidden_states, image_mask = _pad_stack(rows)
    target_mask = torch.zeros_like(image_mask)
    for i, n in enumerate(target_lens):
        target_mask[i, :n] = True
    encoder_hidden_states, encoder_mask = _pad_stack([p.to(device=rows[0].device, dtype=dtype) for p in prompt_embeds])
    return PackedBatch(
        hidden_states=hidden_states,
        encoder_hidden_states=encoder_hidden_states,
        encoder_mask=encoder_mask,
        image_mask=image_mask,
        target_mask=target_mask,
        img_shapes=[[tuple(int(v) for v in s) for s in shapes] for shapes in img_shapes],
    )



# ---------------------------------------------------------------------------------------------- forward


def multires_forward(transformer, batch: PackedBatch, timestep: Tensor, **kwargs) -> Tensor:
    """Run the transformer on a padded batch; returns [B, S_img, 4C] with exact zeros at padded positions.

    timestep: [B] sigma (t/1000), the convention of the diffusers edit pipelines. Extra kwargs go to the
    transformer's forward (e.g. `attention_kwargs={"scale": ...}`, `guidance`). `transformer` may be wrapped
    (DDP from accelerate.prepare): the call goes through the wrapper so gradients synchronise.
    """
    if not is_installed(transformer):
        raise RuntimeError("call models.multires.install_multires(transformer) before multires_forward")
    shapes = batch.img_shapes
    image_padded = not bool(batch.image_mask.all())
    text_padded = not bool(batch.encoder_mask.all())
    attention_kwargs = dict(kwargs.pop("attention_kwargs", None) or {})
    if all(s == shapes[0] for s in shapes):
        # Same shapes (hence no image padding): the stock path, bit-identical to the unmodified model.
        img_shapes = [list(s) for s in shapes]
    else:
        text_lens = batch.text_lens
        longest = batch.hidden_states.shape[1]
        img_shapes = []
        for s, n, t in zip(shapes, batch.image_lens, text_lens):
            pad = [PadShape(longest - n)] if longest > n else []
            img_shapes.append(SampleShapes(list(s) + pad, text_len=t))
        if image_padded:
            attention_kwargs["image_mask"] = batch.image_mask
    image_mask = attention_kwargs.get("image_mask")
    if image_mask is not None or text_padded:
        # The attention layout of this forward, once for every block (and every checkpoint recompute).
        b, s_img = batch.hidden_states.shape[:2]
        attention_kwargs["joint_layout"] = joint_layout(
            batch.encoder_mask if text_padded else None, image_mask, b, batch.encoder_mask.shape[1], s_img,
            batch.hidden_states.device, packed=_uses_packed(transformer))
    out = transformer(
        hidden_states=batch.hidden_states,
        encoder_hidden_states=batch.encoder_hidden_states,
        encoder_hidden_states_mask=batch.encoder_mask if text_padded else None,
        timestep=timestep,
        img_shapes=img_shapes,
        attention_kwargs=attention_kwargs or None,
        return_dict=False,
        **kwargs,
    )[0]
    if image_padded:
        # where (not multiply) so gradients reaching padded inputs are exactly 0, even through inf/nan.
        out = torch.where(batch.image_mask[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


def _uses_packed(transformer) -> bool:
    return any(getattr(p, "_multires_backend", None) == PACKED for p in _unwrap(transformer).attn_processors.values())


def target_outputs(out: Tensor, batch: PackedBatch) -> list[Tensor]:
    """Per-sample [N_i, 4C] target predictions (targets come first in each sample's sequence)."""
    return [out[i, :n] for i, n in enumerate(batch.target_lens)]


__all__ = [
    "PadShape",
    "SampleShapes",
    "PerSampleRope",
    "MaskedJointAttnProcessor",
    "install_multires",
    "is_installed",
    "pack_latents",
    "unpack_latents",
    "PackedBatch",
    "build_batch",
    "multires_forward",
    "target_outputs",
]
