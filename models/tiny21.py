"""Build a tiny random-init Qwen-Image-2.1 pipeline offline (the `qwen-image-2.1` variant of models/tiny.py).

The folder loads with plain `QwenImage21Pipeline.from_pretrained(folder)`: stock `QwenImage21Transformer2DModel`,
`AutoencoderKLQwenImage21` (RGBA in and out, 64 latent channels, 16x downsampling), a tiny Qwen3-VL text
encoder over the tiny model's locally trained BPE tokenizer, the stock `Qwen3VLProcessor` and the 2.1 scheduler
config. Structure is the real one (VLM patch 16 x merge 2 = one slot per 2x2 latent tokens of 16 px, 4 VAE
downsamplings, 64 channels, block-causal transformer with `causal_condition`); only widths and depths are tiny.
"""

from __future__ import annotations

import torch

from models.tiny import CHAT_TEMPLATE, build_tokenizer, special_token_ids

TINY_TRANSFORMER_21 = dict(
    patch_size=1,
    in_channels=64,
    out_channels=64,
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    context_in_dim=32,
    mlp_ratio=3,
    axes_dims_rope=(8, 12, 12),
    causal_condition=True,
)

TINY_VAE_21 = dict(
    base_dim=8,
    decoder_base_dim=8,
    z_dim=64,
    dim_mult=[1, 2, 2, 2, 2],
    num_res_blocks=1,
    temperal_downsample=[False, True, True, True],
    in_channels=4,
    out_channels=4,
)

# The 2.1 pipeline's calculate_shift defaults (base 0.5 at 256 tokens, max 1.15 at 4096 tokens).
SCHEDULER_CONFIG_21 = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)

# One VLM slot covers 32x32 pixels (patch 16, merge 2) = 2x2 latent tokens of the 16x VAE.
VLM_PATCH, VLM_MERGE = 16, 2


def build_text_encoder_21(tokenizer, seed: int, text: dict | None = None, vision: dict | None = None):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text_ids, vl_ids = special_token_ids(tokenizer)
    text = text or dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True},
    )
    vision = vision or dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[1],
        out_hidden_size=text["hidden_size"],
    )
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            **text_ids,
            **text,
        ),
        vision_config=dict(in_channels=3, patch_size=VLM_PATCH, spatial_merge_size=VLM_MERGE, temporal_patch_size=2,
                           **vision),
        **vl_ids,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(config).eval()


def build_processor_21(tokenizer, max_pixels: int = 512 * 512):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    # min_pixels one slot: the pipeline hands the processor images already sized to multiples of 32, so the
    # processor's own resize keeps them and the VLM grid equals the VAE grid (max_pixels bounds the tiny model).
    image_processor = Qwen2VLImageProcessor(
        min_pixels=32 * 32, max_pixels=max_pixels, patch_size=VLM_PATCH, merge_size=VLM_MERGE, temporal_patch_size=2
    )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    )


def build_pipeline_21(seed: int = 0):
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )

    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder_21(tokenizer, seed)
    torch.manual_seed(seed + 1)
    transformer = QwenImage21Transformer2DModel(**TINY_TRANSFORMER_21).eval()
    torch.manual_seed(seed + 2)
    z = TINY_VAE_21["z_dim"]
    vae = AutoencoderKLQwenImage21(
        **TINY_VAE_21,
        latents_mean=[round(0.05 * (i % 8 - 3.5), 4) for i in range(z)],
        latents_std=[round(1.0 + 0.125 * (i % 4), 4) for i in range(z)],
    ).eval()
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG_21),
        vae=vae,
        text_encoder=text_encoder,
        processor=build_processor_21(tokenizer),
        transformer=transformer,
    )


# ---------------------------------------------------------------------------------------------- full width

# The real widths (the rehearsal of models/full_width.py for 2.1): the transformer and VAE are diffusers'
# defaults for these classes (the released config: 32 blocks of 32 x 128, context 4096, RGBA 64-channel VAE);
# the text encoder is Qwen3-VL-8B's layout (from its published config). The vocabulary is the tiny BPE's, as
# for the Edit full-width model.
REAL_LAYERS_21 = {"transformer": 32, "text": 36, "vision": 27}
QWEN3_VL_8B_TEXT = dict(
    hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=262144, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                     "mrope_interleaved": True},
)
QWEN3_VL_8B_VISION = dict(hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                          num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])


def build_full_width_pipeline_21(layers: int | None = None, seed: int = 0, minimal_text_encoder: bool = False):
    """Real widths, `layers` blocks per stack (default: the real counts), bf16. minimal_text_encoder: one
    4096-wide text layer with a narrow MLP and a narrow one-block vision tower (tests)."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline, QwenImage21Transformer2DModel

    from models.full_width import _default_dtype

    n_tr, n_te, n_vi = (layers or REAL_LAYERS_21[k] for k in ("transformer", "text", "vision"))
    text, vision = dict(QWEN3_VL_8B_TEXT), dict(QWEN3_VL_8B_VISION)
    if minimal_text_encoder:
        n_te, n_vi = 1, 1
        text["intermediate_size"] = 256
        vision.update(hidden_size=64, intermediate_size=128, num_heads=2)
    vision["deepstack_visual_indexes"] = [i for i in vision["deepstack_visual_indexes"] if i < n_vi] or [n_vi - 1]
    tokenizer = build_tokenizer()
    with _default_dtype(torch.bfloat16):
        text_encoder = build_text_encoder_21(tokenizer, seed, text={**text, "num_hidden_layers": n_te},
                                             vision={**vision, "depth": n_vi})
        torch.manual_seed(seed + 1)
        transformer = QwenImage21Transformer2DModel(num_layers=n_tr).eval()
        torch.manual_seed(seed + 2)
        vae = AutoencoderKLQwenImage21().eval()
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG_21),
        vae=vae,
        text_encoder=text_encoder,
        # the pipeline hands the processor references already at the reference area (1024² by default):
        # limits that never resize them, so the VLM grid is the VAE grid
        processor=build_processor_21(tokenizer, max_pixels=4096 * 4096),
        transformer=transformer,
    )
