"""Run by each of two gloo processes (tests/stages/test_train_ddp.py, not a test module itself): one optimizer step
with LoRA dropout on; prints `RESULT rng: <sha256>` of the global torch RNG state (what LoRA dropout draws its
masks from) as the first forward of the run begins.

    rank_dropout_rng.py STORE MODEL OUT
"""

from __future__ import annotations

import hashlib
import sys

import torch

from pipeline.config import load_config


def main() -> None:
    store, model, out = sys.argv[1:4]
    from stages.train import recipe

    real = recipe.backward_of
    states: list[str] = []

    def recording(*a, **k):
        if not states:
            states.append(hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest())
        return real(*a, **k)

    recipe.backward_of = recording
    train = {"train.device": "cpu", "train.lora.rank": 4, "train.lora.dropout": 0.5, "train.max_steps": 1,
             "train.batch_size": 1, "train.sigma.sampling": "uniform"}
    recipe.run(load_config(None, train), store, model, out)
    print(f"RESULT rng: {states[0]}", flush=True)


if __name__ == "__main__":
    main()
