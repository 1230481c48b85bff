"""Run by each of two gloo processes (tests/stages/test_step_loss_reference.py, not a test module itself): one
optimizer step of a token-budget run with gradient accumulation, its transformer and LoRA in float64. Rank 0
writes the step's logged loss and the LoRA gradients the optimizer was given (after DDP's all-reduce, before
clipping) to OUT/step1.safetensors.

    rank_float64_step.py STORE MODEL OUT BUDGET ACCUM
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.config import load_config


def main() -> None:
    store, model, out, budget, accum = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4], sys.argv[5]
    from stages.train import recipe

    real_setup, real_clip, real_log = recipe.setup_transformer, recipe._clip, recipe.log
    seen: dict[str, torch.Tensor] = {}

    def setup_float64(*a, **k):
        return real_setup(*a, **k).to(torch.float64)  # frozen base and LoRA

    def clip_recording(params, max_norm):
        for i, p in enumerate(params):
            seen[f"grad.{i}"] = p.grad.detach().clone()
        return real_clip(params, max_norm)

    def log_recording(r, stats):
        seen["loss"] = torch.tensor([stats.loss], dtype=torch.float64)
        seen["grad_norm"] = torch.tensor([stats.grad_norm], dtype=torch.float64)
        return real_log(r, stats)

    recipe.setup_transformer, recipe._clip, recipe.log = setup_float64, clip_recording, log_recording
    train = {"train.device": "cpu", "train.lora.rank": 4, "train.max_steps": 1, "train.max_tokens_per_batch": int(budget),
             "train.grad_accum": int(accum), "train.sigma.sampling": "uniform", "train.learning_rate": 1e-3}
    recipe.run(load_config(None, train), store, model, out / "run")
    if os.environ["RANK"] == "0":
        save_file(seen, out / "step1.safetensors")


if __name__ == "__main__":
    main()
