"""The one-line train summary that `pipeline run train`, `run all` and the demo print.

Single-step losses swing with each step's σ and noise draw far more than training moves them, so the line
compares epoch means (every sample seen once, the same mix of σ), not the first and the last step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from schemas.units import count_text


@dataclass(frozen=True)
class EpochLoss:
    epoch: int
    mean: float
    steps: int  # optimizer steps of this start that began in the epoch (fewer when resumed mid-epoch)


def epoch_losses(losses: list[float], epochs: list[int]) -> list[EpochLoss]:
    """Mean per-step loss of each epoch, in order (steps are attributed to the epoch they began in). Non-finite
    losses (steps `train.on_nonfinite=skip_step` skipped) are left out: one NaN would make every mean NaN."""
    out: list[EpochLoss] = []
    for loss, epoch in zip(losses, epochs):
        if not math.isfinite(loss):
            continue
        if out and out[-1].epoch == epoch:
            last = out[-1]
            out[-1] = EpochLoss(epoch, (last.mean * last.steps + loss) / (last.steps + 1), last.steps + 1)
        else:
            out.append(EpochLoss(epoch, loss, 1))
    return out


def loss_phrase(losses: list[float], epochs: list[int]) -> str:
    """'train loss 1.4021 (epoch 0 mean, 4 steps) -> 0.9712 (epoch 14 mean, 4 steps)', or one epoch's mean."""
    per_epoch = epoch_losses(losses, epochs)
    if not per_epoch:
        return "no steps trained"
    first, last = per_epoch[0], per_epoch[-1]
    if first.epoch == last.epoch:
        if first.steps == 1:
            return f"train loss {first.mean:.4f} (the one step of epoch {first.epoch})"
        return f"train loss {first.mean:.4f} (mean of {first.steps} steps in epoch {first.epoch})"
    return (f"train loss {first.mean:.4f} (epoch {first.epoch} mean, {count_text(first.steps, 'step')}) -> "
            f"{last.mean:.4f} (epoch {last.epoch} mean, {count_text(last.steps, 'step')})")


def train_line(start_step: int, steps: int, losses: list[float], epochs: list[int], lora_dir,
               init_lora: str | None = None, skipped: int = 0, all_damaged: int = 0) -> str:
    """`skipped`: steps train.on_nonfinite=skip_step left without an update; `all_damaged`: steps whose every
    sample was damaged (train.on_damaged=skip), no update either. Neither is in the means (their loss is NaN)."""
    if start_step and start_step == steps:  # a checkpoint at max_steps (a killed final save, a lowered max_steps)
        return f"nothing left to train: the LoRA of checkpoint step-{steps}; LoRA: {lora_dir}"
    how = (f"resumed at step {start_step}" if start_step else f"from init_lora {init_lora}" if init_lora
           else "from scratch")
    notes = [f"{skipped} non-finite step(s) skipped"] if skipped else []
    notes += [f"{all_damaged} step(s) with every sample damaged, no update"] if all_damaged else []
    skip = f" ({'; '.join(notes)}, not in the means)" if notes else ""
    return f"trained {how} to step {steps}: {loss_phrase(losses, epochs)}{skip}; LoRA: {lora_dir}"
