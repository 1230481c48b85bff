"""The optimizer and its LR schedule: diffusers' schedules (`get_scheduler`) with a warm-up read one step ahead."""

from __future__ import annotations

from typing import Callable

import torch

from schemas.config import TrainConfig


#: train.lr_schedule -> the name of diffusers' schedule (`diffusers.optimization.get_scheduler`) with that shape
LIBRARY_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def lr_schedule(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of the base LR per optimizer step (0-based): diffusers' schedule of `train.lr_schedule` with
    linear warm-up. The warm-up is read one step ahead, so the first step trains at 1/warmup_steps of the LR,
    not at 0 (a step at LR 0 would do nothing); from the end of the warm-up on it is the library's, step for step."""
    from diffusers.optimization import get_scheduler

    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # get_scheduler wants an optimizer
    library = get_scheduler(LIBRARY_SCHEDULES[cfg.lr_schedule], probe, num_warmup_steps=cfg.warmup_steps,
                            num_training_steps=cfg.max_steps).lr_lambdas[0]
    warmup = cfg.warmup_steps
    return lambda step: library(step + 1 if step < warmup else step)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the base LR for optimizer step `step` (0-based): `lr_schedule(cfg)` at that step."""
    return lr_schedule(cfg)(step)

def make_optimizer(params, cfg: TrainConfig):
    from stages.train.optimizers import build_optimizer

    optimizer = build_optimizer(params, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg))
    return optimizer, scheduler
