"""Predicted peak memory of each stage from parameter and token counts (`pipeline plan`).

Parameter counts come from the model's own configs, instantiated on the meta device (no weights read).
Bytes per weight follow the configured dtype / quantisation (int8, fp8: 1 byte + a float32 scale per output
channel (+ an int8 zero point for int8); nf4: half a byte + a float32 absmax per block of 64; the non-block
modules stay in the load dtype). Activations are what autograd keeps for the backward per transformer block
and token (counted from the block's saved tensors, per family: ActivationUnits below), plus the
working set of one block's backward. Offload keeps `blocks_on_device` blocks resident and streams the
others (two in flight: the one computing and the one prefetched). Training also holds, when configured, DDP's
gradient buckets (several processes), the validator's float32 VAE (sample grids) and the EMA's shadow. A VAE
decode (sample grids, evaluate, predict) is traced on fake tensors from the VAE's config (`vae_decode_bytes`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from models.loading import resolve_model

# The published component configs (transformer, text_encoder, vae config.json) of the hub models, shipped
# with the package: planning needs only parameter counts, and a user plans before downloading 60 GB.
PUBLISHED = {f"Qwen/{name}": Path(__file__).parent / "published" / name
             for name in ("Qwen-Image-Edit", "Qwen-Image-Edit-2509", "Qwen-Image-Edit-2511")}


def config_root(model: str) -> Path:
    """Where the component configs of `model` are: a local folder as is, a published hub id from the shipped
    configs (no network), anything else through the hub cache."""
    if model in PUBLISHED and not Path(model).expanduser().is_dir():
        return PUBLISHED[model]
    return resolve_model(model)


def plan_family(model: str) -> str:
    """The pipeline family (`models.loading.pipeline_family`: edit, edit-plus, qwen-image-2.1) that decides a
    sample's sequence; the shipped published configs have no model_index, their names say it."""
    if model in PUBLISHED and not Path(model).expanduser().is_dir():
        return "edit" if model == "Qwen/Qwen-Image-Edit" else "edit-plus"
    from models.loading import model_variant, pipeline_family

    return pipeline_family(model_variant(model))


def is_qwen21(model: str) -> bool:
    """A Qwen-Image-2.1 folder (its model_index names QwenImage21Pipeline, as models.loading.model_variant
    reads it); the shipped published configs are all Edit models and have no model_index."""
    from models.loading import QWEN21_PIPELINE

    index = config_root(model) / "model_index.json"
    return index.is_file() and json.loads(index.read_text()).get("_class_name") == QWEN21_PIPELINE


@dataclass(frozen=True)
class ActivationUnits:
    """What training keeps per token, in units of the block width D, compute-dtype elements (the block's family
    decides them: `counts_from_model`)."""

    per_token_block: float  # saved for the backward by one block that keeps its activations
    backward_workset: float  # one block's backward on top of the saved tensors, plus the flow loss inputs
    checkpointed: float  # a checkpointed block's input (one block is recomputed at a time)


# Edit (dual-stream: each image or text token passes its own stream): LayerNorm inputs, modulated inputs, the
# q/k RMSNorms' float32 inputs and outputs, rotated q/k/v and the attention output, gated residuals, the MLP's
# GELU input (4D) and the LoRA inputs. Counted with saved_tensors_hooks on a full-width block with LoRA under bf16
# autocast: 42.0-44.2 bytes per token per D at 320-1280 tokens = 21. Recounted once per storage on the third of
# three blocks set up as the trainer does (bench/block_activations.py, an Edit sample's 80 % image / 20 % text
# tokens): 19.4-19.7, kept at 21 (its plans unchanged: 0.97-0.99 of the H200's measured peaks).
# The backward working set: MLP gradients (2 x 4D) and attention gradients (4 x D) per token, in the compute
# dtype (under bf16 autocast the activation gradients are bf16; counting them as float32 put the plan 12-17 %
# above every measured CPU peak, the same ~0.09 GiB at 1 and 2 layers), plus the flow loss inputs. With
# gradient checkpointing a block keeps its input (D per token, both streams together).
EDIT_ACTIVATIONS = ActivationUnits(per_token_block=21, backward_workset=12, checkpointed=1)
# Qwen-Image-2.1 (single-stream: every token passes the whole block), counted the same way at full width (4096,
# 32 x 128): 29.2-29.5 per token at 320-1280 tokens, 40 % above Edit's 21 (the tiny model's ~29 was no small-width
# artefact). Its SwiGLU MLP keeps 3 x 3D per token (gate input, SiLU output, up projection; an Edit block's GELU
# MLP keeps its 4D GELU input) and every token passes the LoRA'd projections, each keeping its own copy of the
# input (peft casts it to the float32 adapter, autocast back). The mask copy SDPA saves per block is S², not per
# token: `qwen21_mask_bytes` (equal to the measured copy). One block's backward peaks at 8.0 D per token above
# its saved tensors, an Edit block's at 6.4 (8 per token of the image stream, 80 % of the tokens), both at full
# width: the working set is Edit's 12 + 1.6, rounded up. A checkpointed block keeps one [tokens, D] input.
QWEN21_ACTIVATIONS = ActivationUnits(per_token_block=29.5, backward_workset=14, checkpointed=1)


# Quantised storage: bytes per weight, scale bytes per output channel (int8: float32 scale + int8 zero point),
# scale bytes per weight (NF4: one float32 absmax per block of 64).
QUANT_BYTES = {"none": None, "int8": (1, 5, 0), "fp8": (1, 4, 0), "nf4": (0.5, 0, 4 / 64)}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class TransformerCounts:
    blocks: int
    width: int
    block_linear_params: int  # weights of the blocks' linears (what quantisation converts)
    block_linear_out_features: int  # sum of their output channels (one scale each when quantised)
    block_other_params: int  # biases, norms inside blocks
    other_params: int  # img_in, txt_in, time embedding, norm_out, proj_out
    largest_linear: int  # weight elements of the biggest block linear (a modulation linear: 3072 x 18432)
    token_linear_params: int  # per block: linear weights one token passes (its stream's attention + MLP;
    #                           the modulation linears act on the timestep embedding, once per sample)
    activations: ActivationUnits  # the family's per-token units (EDIT_ACTIVATIONS, QWEN21_ACTIVATIONS)

    @property
    def params(self) -> int:
        return self.block_linear_params + self.block_other_params + self.other_params


@lru_cache(maxsize=8)
def transformer_counts(model: str) -> TransformerCounts:
    from accelerate import init_empty_weights
    from diffusers import QwenImage21Transformer2DModel, QwenImageTransformer2DModel

    cfg = json.loads((config_root(model) / "transformer" / "config.json").read_text())
    cls = QwenImage21Transformer2DModel if is_qwen21(model) else QwenImageTransformer2DModel
    with init_empty_weights():
        tr = cls.from_config(cfg)
    return counts_from_model(tr)


def counts_from_model(tr) -> TransformerCounts:
    """The counts of an instantiated transformer (meta, host or device; before LoRA is added)."""
    import torch

    lin = lin_out = per_token = largest = 0
    for name, module in tr.transformer_blocks[0].named_modules() if len(tr.transformer_blocks) else []:
        if isinstance(module, torch.nn.Linear) and not name.endswith("_mod.1"):
            per_token += module.weight.numel()
    for module in tr.transformer_blocks.modules():
        if isinstance(module, torch.nn.Linear):
            lin += module.weight.numel()
            lin_out += module.out_features
            largest = max(largest, module.weight.numel())
    block_total = sum(p.numel() for p in tr.transformer_blocks.parameters())
    other_in_blocks = block_total - lin
    total = sum(p.numel() for p in tr.parameters())
    width = tr.config.num_attention_heads * tr.config.attention_head_dim
    # Edit blocks are dual-stream (image and text tokens each pass one of the two streams' linears); a 2.1
    # block is single-stream (every token passes all its linears; its modulation is one shared module).
    streams = 2 if len(tr.transformer_blocks) and hasattr(tr.transformer_blocks[0], "txt_mlp") else 1
    from models.qwen21_flow import is_qwen21 as is_qwen21_model

    units = QWEN21_ACTIVATIONS if is_qwen21_model(tr) else EDIT_ACTIVATIONS
    return TransformerCounts(len(tr.transformer_blocks), width, lin, lin_out, other_in_blocks, total - block_total,
                             largest, per_token // streams, units)


@lru_cache(maxsize=8)
def component_params(model: str, component: str) -> int:
    """Parameter count of the text encoder or the VAE, from its config on the meta device."""
    from accelerate import init_empty_weights

    root = config_root(model) / component
    with init_empty_weights():
        if is_qwen21(model):  # Qwen3-VL text encoder, the RGBA 64-channel VAE (models/tiny21.py)
            if component == "text_encoder":
                from transformers import AutoConfig, Qwen3VLForConditionalGeneration

                m = Qwen3VLForConditionalGeneration(AutoConfig.from_pretrained(root))
            else:
                from diffusers import AutoencoderKLQwenImage21

                m = AutoencoderKLQwenImage21.from_config(json.loads((root / "config.json").read_text()))
        elif component == "text_encoder":
            from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

            m = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(root))
        else:
            from diffusers import AutoencoderKLQwenImage

            m = AutoencoderKLQwenImage.from_config(json.loads((root / "config.json").read_text()))
    return sum(p.numel() for p in m.parameters())


def vae_class(model: str):
    """The VAE class of the model's family (2.1: RGBA, 64 channels, 16 px per latent; the others 8 px)."""
    if is_qwen21(model):
        from diffusers import AutoencoderKLQwenImage21

        return AutoencoderKLQwenImage21, 16
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage, 8


def vae_decode_bytes(model: str, dtype: str, height: int, width: int) -> int:
    """Peak bytes one VAE decode of a height x width image allocates beyond the VAE's weights (`vae_pass_bytes`)."""
    return vae_pass_bytes(model, dtype, height, width)


def vae_pass_bytes(model: str, dtype: str, height: int, width: int, encode: bool = False, batch: int = 1) -> int:
    """Peak bytes one VAE decode of a height x width image (or `encode` of `batch` such images) allocates beyond
    the VAE's weights (its input, the feature maps, the causal convolutions' frame caches, the output): traced on
    fake tensors (`FakeTensorMode`: shapes only, nothing allocated, no weight read) under torch's own
    `MemTracker`, built from the model's VAE config. Traced rather than a formula: the peak sits in the
    full-resolution stage, whose caches and up-sampling copies a hand count missed (the encode's "handful of
    feature maps" was 1.7x under it; tests/models/test_memory_plan_decode.py checks both against the live
    tensors of a real pass). A trace takes seconds: it is kept per VAE config, not per model name (the published
    Edit models share one VAE config; a local copy of one and its hub id too)."""
    cls, scale = vae_class(model)
    cfg = (config_root(model) / "vae" / "config.json").read_text()
    return _traced_pass_bytes(cls, scale, cfg, dtype, height, width, encode, batch)


@lru_cache(maxsize=32)
def _traced_pass_bytes(cls, scale: int, config_json: str, dtype: str, height: int, width: int, encode: bool,
                       batch: int) -> int:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    cfg = json.loads(config_json)
    default, elem = torch.get_default_dtype(), getattr(torch, dtype)
    with FakeTensorMode():
        torch.set_default_dtype(elem)  # built in the dtype: a fake module cannot be cast
        try:
            vae = cls.from_config(cfg).eval()
        finally:
            torch.set_default_dtype(default)
        tracker = MemTracker()
        tracker.track_external(vae)
        with tracker, torch.no_grad():  # the input counted too: it is on the device through the pass
            if encode:
                channels = getattr(vae.config, "input_channels", None) or vae.config.in_channels  # Edit 3, 2.1: 4
                vae.encode(torch.zeros(batch, channels, 1, height, width, dtype=elem))
            else:
                vae.decode(torch.zeros(batch, vae.config.z_dim, 1, height // scale, width // scale, dtype=elem),
                           return_dict=False)
    peak = tracker.get_tracker_snapshot("peak")
    return sum(v["Total"] for v in peak.values()) - sum(p.numel() * p.element_size() for p in vae.parameters())


@dataclass
class StagePlan:
    stage: str
    parts: dict[str, int]  # name -> bytes

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def transformer_weight_bytes(c: TransformerCounts, dtype: str, quantize: str, blocks_resident: int | None = None) -> int:
    """Bytes of the transformer's weights on the device (`blocks_resident` of the blocks, default all)."""
    elem = DTYPE_BYTES[dtype]
    q = QUANT_BYTES[quantize]
    per_weight, per_channel, per_weight_scale = q if q else (elem, 0, 0)
    per_block = (c.block_linear_params * (per_weight + per_weight_scale) + c.block_linear_out_features * per_channel
                 + c.block_other_params * elem) / c.blocks
    resident = c.blocks if blocks_resident is None else min(c.blocks, blocks_resident)
    return int(per_block * resident + c.other_params * elem)


def lora_params(c: TransformerCounts, rank: int, targets: int = 4) -> int:
    """LoRA on `targets` square D x D projections per block (to_q, to_k, to_v, to_out.0 by default)."""
    return c.blocks * targets * rank * 2 * c.width


def lora_shapes(c: TransformerCounts, rank: int, targets: int = 4) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, starts at zero) of the adapter's matrices on `targets` D x D projections per block: lora_A
    (rank x D, random) and lora_B (D x rank, zeros: peft's init, so the adapter starts as the base)."""
    return [((rank, c.width), False), ((c.width, rank), True)] * (c.blocks * targets)


# The fp32 LoRA weight and its gradient (the trainer keeps the adapter in float32 whatever the base's dtype).
LORA_PARAM_AND_GRAD_BYTES = 8
# bitsandbytes' 8-bit optimizers quantise their states blockwise: one float32 absmax per block of 256, and two
# 256-entry float32 code tables shared by every tensor.
BNB_BLOCK, BNB_QMAPS = 256, 2 * 256 * 4


def optimizer_state_bytes(optimizer: str, params: list[tuple[tuple[int, ...], bool]]) -> int:
    """Bytes of `train.optimizer`'s state (stages/train/optimizers.py) after a step for parameters given as
    (shape, starts at zero), as each library keeps it (checked against their state dicts in
    tests/models/test_memory_plan_optimizer.py): AdamW two fp32 moments + a step tensor; AdamW 8-bit two uint8
    states + one fp32 absmax per block of 256; Adafactor a factored fp32 second moment (rows + cols) + an RMS
    scalar; Prodigy three fp32 states (exp_avg, exp_avg_sq, s) + p0, a copy of the starting weight (a scalar
    for one that starts at zero)."""
    def numel(shape):
        n = 1
        for d in shape:
            n *= d
        return n

    if optimizer == "adamw":
        return sum(8 * numel(s) + 4 for s, _ in params)
    if optimizer == "adamw8bit":
        return sum(2 * numel(s) + 2 * 4 * -(-numel(s) // BNB_BLOCK) for s, _ in params) + BNB_QMAPS
    if optimizer == "adafactor":
        return sum(4 * (numel(s[:-1]) + numel(s[:-2] + s[-1:]) if len(s) >= 2 else numel(s)) + 4 for s, _ in params)
    if optimizer == "prodigy":
        return sum(12 * numel(s) + (4 if zero else 4 * numel(s)) for s, zero in params)
    raise ValueError(f"no memory plan for optimizer {optimizer!r}")


# Float32 bytes per trainable (LoRA) parameter of DDP's gradient buckets: with several processes DDP copies every
# gradient into flat buckets of the parameters' dtype for the all-reduce (torch's default
# gradient_as_bucket_view=False: the buckets come on top of the .grad tensors; stages/train/parallel.py), and of
# the EMA's float32 shadow copy of the adapter (stages/train/ema.py, `train.ema_decay`). Checked against the
# tensors DDP hands its comm hook and the EMA holds (tests/models/test_memory_plan_terms.py).
DDP_BUCKET_BYTES = 4
EMA_BYTES = 4


def train_plan(model: str, dtype: str, quantize: str, batch_size: int, tokens_per_sample: int,
               gradient_checkpointing: bool, lora_rank: int, offload: str = "none", blocks_on_device: int = 0,
               lora_targets: int = 4, host: bool = False, counts: TransformerCounts | None = None,
               optimizer: str = "adamw", processes: int = 1, sample_vae: bool = False, ema: bool = False,
               vae_params: int | None = None, sample_size: tuple[int, int] | None = None,
               uncheckpointed_blocks: int = 0) -> StagePlan:
    """Peak device bytes of training; `host=True`: peak host RSS of a CPU run instead (everything resident,
    and the loading peak counts when it is the higher one). `counts`: of a model built in memory (bench).
    `optimizer`: `train.optimizer`, whose state is planned as that library keeps it. `processes` > 1: DDP's
    gradient buckets. `sample_vae` (`train.sample_every` set): the float32 VAE the validator loads on the main
    process's device for its sample grids and keeps for the run (`vae_params`: its count, default from the
    model's VAE config); with `sample_size` (height, width of the val images) also its decode's feature maps, as
    far as they exceed the step's activations (a sample grid runs between steps, when those are freed).
    `ema` (`train.ema_decay` set): the adapter's float32 shadow. `uncheckpointed_blocks`: with checkpointing, the
    leading blocks that keep their activations (`train.uncheckpointed_blocks`)."""
    c = counts or transformer_counts(model)
    # the trainer turns checkpointing on with offload (stages/train/build.py): without it autograd would keep
    # every block's device copy; planned as off, the activations came out ~21x (60 blocks) too high
    gradient_checkpointing = gradient_checkpointing or offload == "blocks"
    if host:
        offload = "none"  # storage and compute are the same memory
    act_elem = DTYPE_BYTES[dtype]
    tokens = batch_size * tokens_per_sample
    resident = None if offload == "none" else min(c.blocks, blocks_on_device + 2)
    # every block keeps its activations without checkpointing; with it the first `uncheckpointed_blocks` do (held
    # through the whole backward: they are the last to run it), the others their input, and one is recomputed
    kept = min(c.blocks, uncheckpointed_blocks) if gradient_checkpointing else c.blocks
    recomputed = 1 if kept < c.blocks else 0
    units = c.activations
    saved = units.per_token_block * (kept + recomputed) + units.checkpointed * (c.blocks - kept)
    parts = {
        "weights": transformer_weight_bytes(c, dtype, quantize, resident),
        "lora+grads": lora_params(c, lora_rank, lora_targets) * LORA_PARAM_AND_GRAD_BYTES,
        f"{optimizer} state": optimizer_state_bytes(optimizer, lora_shapes(c, lora_rank, lora_targets)),
        "activations": int(tokens * c.width * saved * act_elem),
        "backward working set": int(tokens * c.width * units.backward_workset * act_elem),
    }
    adapter = lora_params(c, lora_rank, lora_targets)
    if processes > 1:
        parts["DDP gradient buckets"] = adapter * DDP_BUCKET_BYTES
    if ema:
        parts["EMA"] = adapter * EMA_BYTES
    if sample_vae:
        vae = vae_params if vae_params is not None else component_params(model, "vae")
        parts["validation VAE (float32)"] = 4 * vae
        if sample_size is not None:
            _decode_above(parts, vae_decode_bytes(model, "float32", *sample_size),
                          parts["activations"] + parts["backward working set"], "sample-grid VAE decode")
    if units is QWEN21_ACTIVATIONS:  # the counts' family: a bench passes "" with counts of a model built in memory
        parts["block-causal mask"] = qwen21_mask_bytes(batch_size, tokens_per_sample, act_elem,
                                                       kept + recomputed)
    if host and quantize != "none":
        # loading (models/quantize.py): the quantised weights + one bf16 weight's mapped pages + a row chunk
        load = parts["weights"] + c.largest_linear * DTYPE_BYTES[dtype] + 1024 * c.width * 4 * 4
        excess = load - sum(parts.values())
        if excess > 0:
            parts["loading peak above training"] = excess
    return StagePlan("train", parts)


def largest_uncheckpointed(plan_bytes: Callable[[int], int], most: int, limit_bytes: float) -> int | None:
    """The largest `train.uncheckpointed_blocks` n <= `most` whose planned training peak `plan_bytes(n)` is within
    `limit_bytes` (None: not even n = 0, every block checkpointed). The plan grows with n."""
    fits = [n for n in range(most + 1) if plan_bytes(n) <= limit_bytes]
    return fits[-1] if fits else None


def qwen21_mask_bytes(batch: int, seq: int, elem: int, blocks_saving: int) -> int:
    """2.1's dense block-causal mask (models/qwen21_multires.py), S² per sample, in none of the per-token
    constants: the bool mask, held for the whole step, plus per attention call SDPA's additive copy of it in the
    compute dtype and its logical_not, the copy saved for backward by each block that keeps its inputs (all
    without checkpointing, the recomputed one with). An estimate from the kernels' inputs (not measured on a GPU)."""
    return batch * seq * seq * (2 + elem * blocks_saving)


def encode_plan(model: str, component: str, dtype: str, batch_size: int, tokens_per_sample: int) -> StagePlan:
    """Inference: weights + a few live activations of the widest layer (no autograd)."""
    n = component_params(model, component)
    elem = DTYPE_BYTES[dtype]
    if component == "text_encoder":
        cfg = json.loads((config_root(model) / component / "config.json").read_text())
        text = cfg.get("text_config", cfg)
        live = batch_size * tokens_per_sample * (4 * text["hidden_size"] + 2 * text["intermediate_size"]) * elem
    else:  # VAE: a batch of images of the sample's area (16 x 16 px per token), traced
        side = max(64, math.isqrt(tokens_per_sample * 256) // 64 * 64)
        live = vae_pass_bytes(model, dtype, side, side, encode=True, batch=batch_size)
    return StagePlan(f"encode-{'text' if component == 'text_encoder' else 'vae'}", {"weights": n * elem, "activations": live})


def inference_plan(model: str, dtype: str, quantize: str, tokens_per_sample: int, cfg_batch: int = 2,
                   image_size: tuple[int, int] | None = None) -> StagePlan:
    """evaluate / predict: the transformer's forward of `cfg_batch` rows (true CFG doubles a picture's batch;
    evaluate's held-out loss runs `evaluate.batch_size` rows a forward), no saved activations; 2.1's block-causal
    mask per row as the train plan counts it for the one block that holds it at a time. With `image_size` (height,
    width of the images made) also the VAE evaluate loads beside the transformer and its decode's feature maps, as
    far as they exceed the forward's (the decode runs after the last denoising step)."""
    c = transformer_counts(model)
    elem = DTYPE_BYTES[dtype]
    parts = {
        "weights": transformer_weight_bytes(c, dtype, quantize),
        "activations": cfg_batch * tokens_per_sample * c.width * 8 * elem,
    }
    if is_qwen21(model):
        parts["block-causal mask"] = qwen21_mask_bytes(cfg_batch, tokens_per_sample, elem, 1)
    if image_size is not None:
        parts["VAE"] = component_params(model, "vae") * elem
        _decode_above(parts, vae_decode_bytes(model, dtype, *image_size), parts["activations"], "VAE decode")
    return StagePlan("evaluate/predict (transformer)", parts)


def _decode_above(parts: dict[str, int], decode: int, activations: int, name: str) -> None:
    """The decode's peak where it exceeds the activations it replaces (never live at the same time)."""
    if decode > activations:
        parts[f"{name} above the activations"] = decode - activations


def gib(n: int | float) -> str:
    return f"{n / 2**30:.2f} GiB"
