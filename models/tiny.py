"""Build a tiny random-init Qwen-Image-Edit (or Edit-Plus, Edit-2511, Qwen-Image-2.1) pipeline offline.

The result is saved with `save_pretrained` and loads with plain diffusers (`QwenImageEditPipeline` /
`QwenImageEditPlusPipeline.from_pretrained(folder)`) with no project import: stock transformer, VAE,
Qwen2.5-VL, a byte-level BPE tokenizer trained here with the Qwen special tokens, the stock
`Qwen2VLProcessor` and the real scheduler config. Structure mirrors the real model (VAE scale 8, 2x2 patches,
16-channel-style packing); only widths and depths are tiny (DESIGN §7).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import torch

Variant = Literal["edit", "edit-plus", "edit-2511", "qwen-image-2.1"]
VARIANTS = ("edit", "edit-plus", "edit-2511", "qwen-image-2.1")

# Qwen2 special tokens, in Qwen's own order so ids are contiguous after the learned vocab.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Text the tokenizer is trained on: the edit pipelines' templates plus the kind of instructions users write.
_CORPUS = [
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then "
    "explain how the user's text instruction should alter or modify the image. Generate a new image that meets "
    "the user's requirements while maintaining consistency with the original input where appropriate.",
    "system user assistant Picture 1: Picture 2: Picture 3: ",
    "make the square red. mirror the scene. turn the circle blue. make the background green. remove the object.",
    "add a hat. change the sky to sunset. make it brighter. rotate the image. replace the car with a bicycle.",
    "The quick brown fox jumps over the lazy dog 0123456789 !?.,;:'\"()[]{}<>/\\-_+=*&^%$#@~`|",
]

TINY_TRANSFORMER = dict(
    patch_size=2,
    in_channels=16,  # 4 latent channels x 2x2 patch
    out_channels=4,
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=32,
    axes_dims_rope=(8, 12, 12),
)

TINY_VAE = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
)

# Real Qwen-Image scheduler config (DESIGN §7).
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)


def build_tokenizer(vocab_size: int = 600):
    """Byte-level BPE trained locally (deterministic), wrapped as the stock `Qwen2Tokenizer`."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    vocab = tok.get_vocab()
    model_json = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model_json["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=dict(sorted(vocab.items(), key=lambda kv: kv[1])),
        merges=merges,
        unk_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=QWEN_SPECIAL_TOKENS[1:],
        model_max_length=32768,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def special_token_ids(tokenizer) -> tuple[dict[str, int], dict[str, int]]:
    """The tokenizer's special tokens where a Qwen VL config takes them (Qwen2.5-VL's and Qwen3-VL's alike): (the
    text config's bos / eos / pad ids, the VL config's image, video and vision start / end ids)."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    text = dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vl = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
              vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    return text, vl


def build_text_encoder(tokenizer, seed: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text_ids, vl_ids = special_token_ids(tokenizer)
    vocab_size = len(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            **text_ids,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            out_hidden_size=32,
            fullatt_block_indexes=[1],
        ),
        **vl_ids,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    return model.eval()


def build_processor(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    # Small max_pixels keeps the VL view cheap on CPU; the real model uses 12845056.
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=224 * 224, patch_size=14, merge_size=2)
    video_processor = Qwen2VLVideoProcessor()
    return Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def build_pipeline(variant: Variant = "edit", seed: int = 0):
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageEditPlusPipeline,
        QwenImageTransformer2DModel,
    )

    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(tokenizer, seed)
    torch.manual_seed(seed + 1)
    # Edit-2511 is the Edit-Plus pipeline over a transformer with `zero_cond_t` (controls modulated at t = 0).
    transformer = QwenImageTransformer2DModel(**TINY_TRANSFORMER, zero_cond_t=variant == "edit-2511").eval()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLQwenImage(
        **TINY_VAE,
        latents_mean=[round(0.1 * (i - 1.5), 4) for i in range(TINY_VAE["z_dim"])],
        latents_std=[round(1.0 + 0.25 * i, 4) for i in range(TINY_VAE["z_dim"])],
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    cls = QwenImageEditPipeline if variant == "edit" else QwenImageEditPlusPipeline
    return cls(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=build_processor(tokenizer),
        transformer=transformer,
    )


def make_tiny_model(out: str | os.PathLike, variant: Variant = "edit", seed: int = 0) -> Path:
    """Build and save into OUT; the same seed gives the same bytes. (`pipeline make-tiny-model` and the demo
    call this inside `store.format.atomic_dir`, so a killed run never leaves a half-written model folder.)"""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: use one of {', '.join(VARIANTS)}")
    out = Path(out)
    if variant == "qwen-image-2.1":  # another pipeline, transformer, VAE and text encoder (models/tiny21.py)
        from models.tiny21 import build_pipeline_21

        pipe = build_pipeline_21(seed)
    else:
        pipe = build_pipeline(variant, seed)
    pipe.save_pretrained(out, safe_serialization=True)
    # Record what built it (a real model folder has no such file; the fingerprint covers the weights anyway).
    (out / "tiny_model.json").write_text(json.dumps({"variant": variant, "seed": seed}, indent=2) + "\n")
    return out
