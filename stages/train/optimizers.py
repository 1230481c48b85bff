"""The trainer's optimizers (`train.optimizer`): AdamW (torch), AdamW 8-bit (bitsandbytes), Adafactor
(transformers), Prodigy (prodigyopt). Each is the library's own class; state is saved by `stages.train.state`.

Missing optional packages are a one-line error naming the pyproject extra that installs them (models/optional.py).
"""

from __future__ import annotations

import torch

from models.optional import require
from schemas.config import TrainConfig
from schemas.errors import UserError

# the module of each optimizer that is not torch's
_MODULE = {"adamw8bit": "bitsandbytes", "adafactor": "transformers.optimization", "prodigy": "prodigyopt"}


def _module(kind: str):
    return require(_MODULE[kind], f"train.optimizer {kind!r}")


def check_installed(cfg: TrainConfig) -> None:
    """The package `train.optimizer` needs, imported as `build_optimizer` will (a UserError naming the extra when it
    is missing): `pipeline run all` asks before its first stage, not after the encoders and the model's load."""
    if cfg.optimizer in _MODULE:
        _module(cfg.optimizer)


def build_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    kind = cfg.optimizer
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
                                 weight_decay=cfg.weight_decay)
    if kind == "adamw8bit":
        # min_8bit_size=0: every LoRA tensor gets 8-bit states (the default 4096 leaves small ones in 32 bit;
        # a real model's LoRA tensors are all larger than that anyway).
        return _module(kind).optim.AdamW8bit(params, lr=cfg.learning_rate, betas=tuple(cfg.adam_betas),
                                             eps=cfg.adam_eps, weight_decay=cfg.weight_decay, min_8bit_size=0)
    if kind == "adafactor":
        # A fixed LR under the trainer's own warm-up/schedule (not Adafactor's relative step).
        return _module(kind).Adafactor(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                       relative_step=False, scale_parameter=False, warmup_init=False)
    if kind == "prodigy":
        return _module(kind).Prodigy(params, lr=cfg.learning_rate, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
                                     weight_decay=cfg.weight_decay)
    raise UserError(f"unknown train.optimizer {kind!r}: use adamw, adamw8bit, adafactor or prodigy")
