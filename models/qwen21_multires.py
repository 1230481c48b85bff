"""Mixed layouts in one batch on an unmodified diffusers `QwenImage21Transformer2DModel` (issue 26).

The stock 2.1 transformer reads one layout for the whole batch (`img_shapes[0]`, `img_mask[0]`): every sample
must have the same references, sizes and prompt image slots. `qwen21_forward` runs a padded batch of samples
with *different* layouts through the same model instance: its own input projections, timestep embedding and
shared modulation, then every stock `QwenImage21TransformerBlock` called as the stock forward calls it (so LoRA
layers, quantised weights, gradient checkpointing, block offload hooks and regional compile apply), then the
stock `norm_out` / `proj_out`. `install_qwen21` sets one attention processor on the instance
(`set_attn_processor`, nothing patched): it is the stock `QwenImage21AttnProcessor` for a stock call and
handles a padded batch's per-sample RoPE and mask otherwise.

Layout of row b (S positions): the sample's joint sequence exactly as the stock model builds it for that sample
alone (the VLM sequence with each image slot expanded to 4 latent tokens, references in order, then the target
tokens), split so that every sample's *target tokens end at S*: [prefix_b | padding | target_b]. All targets
then lie inside one shared region [S - T_max, S), so the blocks' `target_token_mask` (one mask for the batch in
the stock code) gives every prefix token the t = 0 modulation row and every target token its sample's row
(`causal_condition`); padding reads either and is ignored. Relative order within a sample is kept, so per
sample:

- RoPE: the stock `pos_embed` on the sample's own `img_shapes` and image mask, placed at its positions; a
  neutral rotation on padding;
- attention: the block-causal mask `(q >= kv) or same image block` over the sample's own blocks, padded keys
  excluded (a padded query sees only itself, so no row is empty); padded outputs are zeroed at the end.

Attention is one masked SDPA call per block with a dense [B, 1, S, S] boolean mask (exact, any backend that
takes a mask); a flex/varlen kernel is a later optimisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor
from torch import Tensor

Shape = tuple[int, int, int]

# One VLM image slot stands for a 2x2 group of latent tokens (the stock `_IMG_TOKENS_PER_SLOT`).
TOKENS_PER_SLOT = 4
MAX_REFERENCES = 10


@dataclass
class Qwen21Sample:
    """One sample's stored features. prompt_embeds: [L, D] the VLM hidden states the pipeline keeps (system
    tokens dropped, unpadded), slot_mask: [L] bool True at its image slots; references: latents [C, h, w] (or
    [C, 1, h, w]) in prompt order; target: [h_t * w_t, C] target tokens (noised for training) with target_hw."""

    prompt_embeds: Tensor
    slot_mask: Tensor
    references: list[Tensor]
    target: Tensor
    target_hw: tuple[int, int]


@dataclass
class Qwen21Batch:
    """A padded batch of joint sequences (each sample's at [0, n_b), target last, then zero padding)."""

    text: Tensor  # [B, S, D_txt] prompt hidden states at text positions, 0 elsewhere
    image: Tensor  # [B, S, C] reference + target latent tokens at image positions, 0 elsewhere
    image_mask: Tensor  # [B, S] bool: image tokens (references and target)
    target_mask: Tensor  # [B, S] bool: target tokens (the loss positions)
    valid_mask: Tensor  # [B, S] bool: not padding
    image_ids: Tensor  # [B, S] long: -1 at text and padding, a per-sample image block id at image tokens
    img_shapes: list[list[Shape]]  # per sample: references, then the target (latent tokens)
    positions: list[Tensor]  # per sample: the padded position of each token of its joint sequence, in order
    target_region: Tensor  # [S] bool: the shared target region [S - T_max, S) (the blocks' target_token_mask)

    @property
    def lengths(self) -> list[int]:
        return self.valid_mask.sum(dim=1).tolist()

    @property
    def target_lens(self) -> list[int]:
        return [prod(s[-1]) for s in self.img_shapes]

    def to(self, device, dtype: torch.dtype | None = None) -> "Qwen21Batch":
        return Qwen21Batch(
            text=self.text.to(device=device, dtype=dtype),
            image=self.image.to(device=device, dtype=dtype),
            image_mask=self.image_mask.to(device),
            target_mask=self.target_mask.to(device),
            valid_mask=self.valid_mask.to(device),
            image_ids=self.image_ids.to(device),
            img_shapes=self.img_shapes,
            positions=[p.to(device) for p in self.positions],
            target_region=self.target_region.to(device),
        )

    def joint(self, out: Tensor, b: int) -> Tensor:
        """Sample b's joint sequence (in the stock model's order) out of a padded [B, S, ...] tensor."""
        return out[b][self.positions[b]]


def latent_tokens(latent: Tensor) -> Tensor:
    """[C, h, w] or [C, 1, h, w] -> [h * w, C]: the pipeline's `_pack_latents` (2.1 has no 2x2 packing)."""
    if latent.ndim == 4:
        if latent.shape[1] != 1:
            raise ValueError(f"expected one frame, got a latent of shape {tuple(latent.shape)}")
        latent = latent[:, 0]
    c, h, w = latent.shape
    return latent.reshape(c, h * w).transpose(0, 1)


def tokens_to_latent(tokens: Tensor, h: int, w: int) -> Tensor:
    """Inverse of `latent_tokens`: [h * w, C] -> [C, 1, h, w]."""
    if tokens.shape[0] != h * w:
        raise ValueError(f"{tokens.shape[0]} tokens do not fill a {h}x{w} latent")
    return tokens.transpose(0, 1).reshape(tokens.shape[1], 1, h, w)


def joint_image_mask(slot_mask: Tensor, target_tokens: int) -> tuple[Tensor, Tensor]:
    """(VLM mask with the target's slots appended, image-token mask over the joint sequence), as the stock
    forward expands them (each slot -> 4 latent tokens)."""
    if target_tokens % TOKENS_PER_SLOT:
        raise ValueError(f"target of {target_tokens} tokens is not a whole number of 2x2 slots")
    slots = torch.cat([slot_mask.bool(), slot_mask.new_ones(target_tokens // TOKENS_PER_SLOT, dtype=torch.bool)])
    repeats = torch.where(slots, TOKENS_PER_SLOT, 1)
    return slots, torch.repeat_interleave(slots, repeats)


def build_batch(samples: list[Qwen21Sample]) -> Qwen21Batch:
    """Pad samples of any layouts (0..10 references of any sizes, any prompt lengths) into one batch."""
    if not samples:
        raise ValueError("build_batch: no samples")
    rows = []
    for i, s in enumerate(samples):
        if len(s.references) > MAX_REFERENCES:
            raise ValueError(f"sample {i}: {len(s.references)} references, Qwen-Image-2.1 takes at most {MAX_REFERENCES}")
        if s.prompt_embeds.shape[0] != s.slot_mask.shape[0]:
            raise ValueError(f"sample {i}: {s.prompt_embeds.shape[0]} prompt states but a slot mask of {s.slot_mask.shape[0]}")
        refs = [latent_tokens(r) for r in s.references]
        shapes = [(1, *((r.shape[-2], r.shape[-1]))) for r in s.references] + [(1, *s.target_hw)]
        tgt_n = prod(s.target_hw)
        if s.target.shape[0] != tgt_n:
            raise ValueError(f"sample {i}: {s.target.shape[0]} target tokens for a {s.target_hw} target")
        _, img_pos = joint_image_mask(s.slot_mask, tgt_n)
        n_img = sum(t.shape[0] for t in refs) + tgt_n
        if int(img_pos.sum()) != n_img:
            raise ValueError(
                f"sample {i}: the prompt has {int(s.slot_mask.sum())} image slots ({int(s.slot_mask.sum()) * 4} "
                f"latent tokens) but its references have {n_img - tgt_n} latent tokens: the VLM grid must equal the "
                "VAE grid (each slot is 2x2 latent tokens)"
            )
        rows.append((s, refs, shapes, img_pos))
    targets = [prod(r[2][-1]) for r in rows]
    prefixes = [r[3].shape[0] - t for r, t in zip(rows, targets)]
    longest_prefix, longest_target = max(prefixes), max(targets)
    S = longest_prefix + longest_target
    B = len(samples)
    ref0 = samples[0]
    device = ref0.target.device
    text = ref0.prompt_embeds.new_zeros((B, S, ref0.prompt_embeds.shape[1]))
    image = ref0.target.new_zeros((B, S, ref0.target.shape[1]))
    image_mask = torch.zeros((B, S), dtype=torch.bool, device=device)
    target_mask, valid_mask = torch.zeros_like(image_mask), torch.zeros_like(image_mask)
    image_ids = torch.full((B, S), -1, dtype=torch.long, device=device)
    positions = []
    for b, ((s, refs, shapes, img_pos), p, t) in enumerate(zip(rows, prefixes, targets)):
        pos = torch.cat([torch.arange(p), torch.arange(S - t, S)]).to(device)  # prefix first, target at the end
        positions.append(pos)
        img_pos = img_pos.to(device)
        valid_mask[b, pos] = True
        image_mask[b, pos] = img_pos
        target_mask[b, S - t :] = True
        # Text positions of the joint sequence are, in order, the non-slot positions of the VLM sequence.
        text[b, pos[~img_pos]] = s.prompt_embeds[~s.slot_mask.bool()].to(text.dtype)
        img_idx = pos[img_pos]
        image[b, img_idx] = torch.cat([*refs, s.target]).to(image.dtype)
        image_ids[b, img_idx] = torch.cat(
            [torch.full((prod(sh),), k, dtype=torch.long) for k, sh in enumerate(shapes)]
        ).to(device)
    target_region = torch.arange(S, device=device) >= longest_prefix
    return Qwen21Batch(text, image, image_mask, target_mask, valid_mask, image_ids, [r[2] for r in rows], positions,
                       target_region)


def block_causal_mask(batch: Qwen21Batch) -> Tensor:
    """[B, 1, S, S] bool: per sample `(q >= kv) or same image block`, padded keys excluded; a padded query row
    sees only itself (never an empty row, never a real token).

    Written in place into the one [B, S, S] result: the plain expression of it (causal | same block, & valid,
    | eye) held ~5 such tensors at its peak (measured), 10 GiB per sample at 10 references of 1024² (S ~ 45k)."""
    ids, valid = batch.image_ids, batch.valid_mask
    B, S = ids.shape
    allowed = torch.empty((B, S, S), dtype=torch.bool, device=ids.device)
    pos = torch.arange(S, device=ids.device)
    torch.ge(pos[:, None], pos[None, :], out=allowed[0])  # causal
    allowed[1:] = allowed[0]
    for b in range(B):
        a = allowed[b]
        for k in ids[b].unique().tolist():  # each image block sees itself whole
            if k < 0:
                continue
            idx = (ids[b] == k).nonzero().squeeze(1)
            lo, hi = int(idx[0]), int(idx[-1]) + 1
            if hi - lo == idx.numel():  # a block is one run of positions (build_batch lays them out so)
                a[lo:hi, lo:hi] = True
            else:
                a[idx[:, None], idx[None, :]] = True
        pad = (~valid[b]).nonzero().squeeze(1)
        if pad.numel():
            a[:, pad] = False
            a[pad] = False
            a[pad, pad] = True
    return allowed[:, None]


def per_sample_rope(transformer, batch: Qwen21Batch) -> Tensor:
    """[B, S, D/2] complex: the stock `pos_embed` on each sample's own layout at its positions, 1+0j on padding."""
    device = batch.image.device
    rows = []
    for b, shapes in enumerate(batch.img_shapes):
        pos = batch.positions[b]
        freqs = transformer.pos_embed(shapes, batch.image_mask[b, pos], device=device)
        row = freqs.new_ones((batch.valid_mask.shape[1], freqs.shape[1]))
        row[pos] = freqs
        rows.append(row)
    return torch.stack(rows)


def _rope(x: Tensor, freqs: Tensor) -> Tensor:
    """x [B, S, H, D]; freqs [B, S, D/2] complex: `apply_rotary_emb_qwen(use_real=False)` per sample."""
    x_c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_c * freqs.unsqueeze(2)).flatten(3).type_as(x)


def _attention(attn, hidden: Tensor, freqs: Tensor, mask: Tensor) -> Tensor:
    """The stock QKV projection / q-k norm / RoPE / output projection, one masked attention for all samples."""
    query, key, value = attn.to_q(hidden), attn.to_k(hidden), attn.to_v(hidden)
    head_dim = attn.inner_dim // attn.heads
    query, key, value = (t.unflatten(-1, (-1, head_dim)) for t in (query, key, value))
    query = attn.norm_q(query).to(value.dtype)
    key = attn.norm_k(key).to(value.dtype)
    query, key = _rope(query, freqs), _rope(key, freqs)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask
    ).transpose(1, 2)
    out = out.flatten(2, 3).type_as(query)
    return attn.to_out[1](attn.to_out[0](out))


class PaddedBlockCausalAttnProcessor(QwenImage21AttnProcessor):
    """The stock processor, plus a padded mixed-layout batch: per-sample RoPE ([B, S, D/2]) and a dense
    [B, 1, S, S] boolean mask. A stock call (shared RoPE [S, D/2], segments, KV cache) goes to the stock code."""

    def __call__(self, attn, hidden_states, attention_mask=None, rotary_emb=None, layer_cache=None,
                 kv_cache_mode=None, cache_write_slice=None, segments=None, key_valid=None):
        if rotary_emb is None or rotary_emb.ndim != 3:
            return super().__call__(attn, hidden_states, attention_mask, rotary_emb, layer_cache, kv_cache_mode,
                                    cache_write_slice, segments, key_valid)
        return _attention(attn, hidden_states, rotary_emb, attention_mask)


def install_qwen21(transformer) -> None:
    """Set `PaddedBlockCausalAttnProcessor` on every block of this instance (idempotent; no parameter change)."""
    model = _unwrap(transformer)
    if not all(isinstance(p, PaddedBlockCausalAttnProcessor) for p in model.attn_processors.values()):
        model.set_attn_processor(PaddedBlockCausalAttnProcessor())


class Qwen21Batched(torch.nn.Module):
    """`qwen21_forward` as a module's forward, for DDP: a DistributedDataParallel wrapper only synchronises the
    gradients of a forward that goes through it, and the stock transformer's own forward is the one-layout one.
    Training wraps this (`stages/train/build.py`); it holds the transformer, no parameters of its own."""

    def __init__(self, transformer) -> None:
        super().__init__()
        self.transformer = transformer

    def forward(self, batch: Qwen21Batch, timestep: Tensor) -> Tensor:
        return _forward(self.transformer, batch, timestep)


def qwen21_forward(transformer, batch: Qwen21Batch, timestep: Tensor) -> Tensor:
    """[B, S, C] the model output for every sample's joint sequence (its own layout), 0 at padded positions.

    timestep: [B] in [0, 1] (the pipeline passes t / 1000). Reads the modules of `transformer`, so it runs with
    whatever adapters are attached to them. A `Qwen21Batched` (or a DDP wrapper of one) is called through its
    wrapper, so DDP synchronises the gradients; any other wrapper (compile) is unwrapped."""
    inner = getattr(transformer, "module", transformer)
    if isinstance(inner, Qwen21Batched):
        return transformer(batch, timestep)
    return _forward(transformer, batch, timestep)


def _forward(transformer, batch: Qwen21Batch, timestep: Tensor) -> Tensor:
    model = _unwrap(transformer)
    install_qwen21(model)
    image_mask = batch.image_mask.unsqueeze(-1)
    hidden = torch.where(image_mask, model.img_in(batch.image), model.txt_in(batch.text))
    freqs = per_sample_rope(model, batch)
    mask = block_causal_mask(batch)
    timestep = timestep.to(hidden.dtype)
    if model.config.causal_condition:  # an extra t = 0 row: text and reference tokens modulate from it
        timestep = torch.cat([timestep, timestep.new_zeros(1)])
        modulation_mask = batch.target_region
    else:
        modulation_mask = None
    temb = model.time_text_embed(timestep, hidden)
    modulation = model.modulation(temb)
    for block in model.transformer_blocks:  # called as the stock forward calls them
        if torch.is_grad_enabled() and model.gradient_checkpointing:
            hidden = model._gradient_checkpointing_func(block, hidden, modulation, freqs, mask, modulation_mask,
                                                        None, None, None, None, None)
        else:
            hidden = block(hidden_states=hidden, modulation=modulation, rotary_emb=freqs, attention_mask=mask,
                           target_token_mask=modulation_mask)
    out = model.proj_out(model.norm_out(hidden, temb, modulation_mask))
    # Padded rows ran through the blocks on their own (they see only themselves): zero them, so nothing reads
    # them and their gradient is exactly 0.
    return out * batch.valid_mask.unsqueeze(-1).to(out.dtype)


def target_outputs(out: Tensor, batch: Qwen21Batch) -> list[Tensor]:
    """Each sample's predicted target tokens [h_t * w_t, C] (its own count), in target order."""
    return [out[b][batch.target_mask[b]] for b in range(out.shape[0])]


def per_sample_loss(out: Tensor, target: Tensor, batch: Qwen21Batch, weight: Tensor | None = None) -> Tensor:
    """[B] mean squared error over each sample's own target tokens (normalised per sample, so a large target
    does not outweigh a small one). target: [B, S, C] at target positions (anything elsewhere)."""
    m = batch.target_mask.unsqueeze(-1).to(out.dtype)
    err = (out.float() - target.float()) ** 2
    if weight is not None:
        err = err * weight.float()
    per = (err * m).sum(dim=(1, 2)) / (m.sum(dim=(1, 2)) * out.shape[-1])
    return per


def _unwrap(model):
    """The transformer inside DDP (`.module`), torch.compile (`._orig_mod`) or `Qwen21Batched` wrappers."""
    while True:
        if isinstance(model, Qwen21Batched):
            model = model.transformer
            continue
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None or not isinstance(inner, torch.nn.Module):
            return model
        model = inner
