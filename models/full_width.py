"""A random-init model with the real Qwen-Image-Edit component widths and N layers: the full-size rehearsal.

Widths are the real ones (transformer: 3072 wide, 24 heads x 128, joint_attention_dim 3584, rope axes
(16, 56, 56), 64 packed input channels; Qwen2.5-VL-7B: 3584-wide text with 28 heads / 4 KV heads and an
18944 MLP, a 1280-wide, 16-head vision tower projecting to 3584; the real 16-channel VAE). `layers` sets the
transformer blocks, the text decoder layers and the vision blocks (default: the real 60 / 28 / 32). The
vocabulary is the tiny model's locally trained BPE (~600 tokens instead of 152064: the real embedding table
would add 1.1 GB per copy and nothing to the rehearsal), so token counts are the tiny tokenizer's.

Weights are built in bfloat16 (as the real checkpoint is stored) and saved in shards of about 1/8 of the
transformer, like the real checkpoint's (41 GB in 9 files): loading then streams shard by shard.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from models.tiny import SCHEDULER_CONFIG, Variant, build_processor, build_tokenizer, special_token_ids

REAL_LAYERS = {"transformer": 60, "text": 28, "vision": 32}

FULL_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    axes_dims_rope=(16, 56, 56),
)

QWEN25_VL_7B_TEXT = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)

QWEN25_VL_7B_VISION = dict(
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    out_hidden_size=3584,
)
REAL_FULLATT_BLOCKS = [7, 15, 23, 31]


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _fullatt(depth: int) -> list[int]:
    kept = [i for i in REAL_FULLATT_BLOCKS if i < depth]
    return kept or [depth - 1]  # the last block always attends globally


# Test-only text encoder: the real output width (3584, what the transformer reads) and head layout, one
# layer, a narrow MLP and a narrow vision tower, so a CPU test encodes in seconds.
MINIMAL_TEXT = {**QWEN25_VL_7B_TEXT, "intermediate_size": 256}
MINIMAL_VISION = {**QWEN25_VL_7B_VISION, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2}


def build_text_encoder(tokenizer, layers: int, seed: int, minimal: bool = False, vision_layers: int | None = None):
    """`layers` text decoder layers and (unless `vision_layers` is given) as many vision blocks."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text_ids, vl_ids = special_token_ids(tokenizer)
    text, vision = (MINIMAL_TEXT, MINIMAL_VISION) if minimal else (QWEN25_VL_7B_TEXT, QWEN25_VL_7B_VISION)
    layers = 1 if minimal else layers
    depth = 1 if minimal else vision_layers or layers
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), num_hidden_layers=layers, **text, **text_ids,
        ),
        vision_config=dict(depth=depth, fullatt_block_indexes=_fullatt(depth), **vision),
        **vl_ids,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    with _default_dtype(torch.bfloat16):
        return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_full_width_pipeline(variant: Variant = "edit", layers: int | None = None, seed: int = 0,
                              minimal_text_encoder: bool = False):
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageEditPlusPipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    n_tr = layers or REAL_LAYERS["transformer"]
    n_te = layers or REAL_LAYERS["text"]
    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(tokenizer, n_te, seed, minimal=minimal_text_encoder,
                                      vision_layers=layers or REAL_LAYERS["vision"])  # the real 32 by default
    with _default_dtype(torch.bfloat16):
        torch.manual_seed(seed + 1)
        transformer = QwenImageTransformer2DModel(num_layers=n_tr, **FULL_TRANSFORMER).eval()
        torch.manual_seed(seed + 2)
        vae = AutoencoderKLQwenImage().eval()  # diffusers' defaults are the real Qwen-Image VAE config
    processor = Qwen2VLProcessor(  # the real image processor limits (the tiny model's are smaller)
        image_processor=Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2),
        tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(), chat_template=build_processor(tokenizer).chat_template,
    )
    cls = QwenImageEditPlusPipeline if variant == "edit-plus" else QwenImageEditPipeline
    return cls(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=vae, text_encoder=text_encoder,
               tokenizer=tokenizer, processor=processor, transformer=transformer)


def shard_size(transformer) -> int:
    """About 1/8 of the transformer per shard (the real checkpoint: 41 GB in 9 files), at least 64 MB."""
    total = sum(p.numel() * p.element_size() for p in transformer.parameters())
    return max(64 << 20, total // 8)


def make_full_width_model(out: str | os.PathLike, variant: Variant = "edit", layers: int | None = None,
                          seed: int = 0, minimal_text_encoder: bool = False) -> Path:
    from schemas.errors import UserError

    if variant not in ("edit", "edit-plus", "qwen-image-2.1"):
        raise UserError(f"unknown variant {variant!r}: use 'edit', 'edit-plus' or 'qwen-image-2.1'")
    if layers is not None and layers < 1:
        raise UserError(f"--layers must be at least 1 (got {layers})")
    out = Path(out)  # written in place: `pipeline make-tiny-model` wraps this in store.format.atomic_dir
    if variant == "qwen-image-2.1":  # models/tiny21.py
        from models.tiny21 import build_full_width_pipeline_21

        pipe = build_full_width_pipeline_21(layers, seed, minimal_text_encoder)
    else:
        pipe = build_full_width_pipeline(variant, layers, seed, minimal_text_encoder)
    pipe.save_pretrained(out, safe_serialization=True, max_shard_size=shard_size(pipe.transformer))
    (out / "tiny_model.json").write_text(json.dumps(
        {"variant": variant, "seed": seed, "full_width": True, "layers": layers,
         "minimal_text_encoder": minimal_text_encoder}, indent=2) + "\n")
    return out
