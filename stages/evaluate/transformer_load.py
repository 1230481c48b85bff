"""Evaluate's transformer: loaded once in the resolved dtype and device, multi-resolution installed, on the
attention backend the settings were hashed with."""

from __future__ import annotations

import torch

from models.attention import use_attention_backend
from models.collective import together
from models.loading import load_component, parse_dtype
from models.multires import install_multires
from models.precision import check_loaded_dtype
from models.qwen21_flow import is_qwen21
from schemas.config import EvaluateConfig
from schemas.errors import UserError


def load_transformer(cfg: EvaluateConfig, model: str, world: int = 1):
    """The transformer in the resolved dtype and device, multi-resolution installed, no adapter yet. With several
    ranks (`world`) every rank calls it: the load is agreed on, the attention backend one decision of all ranks."""
    dtype = parse_dtype(cfg.dtype)
    # agreed on: a rank that fails to load stops every rank here, not one left in the backend's agreement below;
    # uneven: a node reading the model from a slower disk comes minutes later (stages/train/build.py)
    with together(world, "load the transformer", uneven=True):
        transformer = load_component(model, "transformer", dtype=dtype, device=cfg.device, quantize=cfg.quantize_base)
        check_loaded_dtype(transformer, cfg.dtype, "evaluate.dtype")
        if not is_qwen21(transformer):  # 2.1: its own mixed-layout forward (models/qwen21_multires.py), images by stages/evaluate/qwen21.py
            install_multires(transformer)
    # the backend the settings were hashed with (`agreed_config`), as decided then: nothing decided again
    used = use_attention_backend(transformer, cfg.attention_backend, "evaluate.attention_backend",
                                 torch.device(cfg.device), dtype, world, cfg._attention_choice)
    if cfg._attention_choice is not None and used != cfg.attention_backend:  # the same on every rank: all stop
        raise UserError(f"evaluate.attention_backend: the model uses {used}, but the report is hashed with "
                        f"{cfg.attention_backend}; report this")
    return transformer
