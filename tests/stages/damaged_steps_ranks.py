"""Run by each of two gloo processes (tests/stages/test_skip_damaged_ranks.py, not a test module itself):
train.on_damaged=skip, one sample per rank per step, on a store where most samples are damaged, so some steps
have no intact sample. Prints `RESULT damaged_steps: [...]` and `RESULT line: <the summary line>`.

    damaged_steps_ranks.py STORE MODEL OUT
"""

from __future__ import annotations

import sys

from pipeline.config import load_config


def main() -> None:
    store, model, out = sys.argv[1:4]
    from stages.train import recipe

    result = recipe.run(load_config(None, {
        "train.device": "cpu", "train.batch_size": 1, "train.lora.rank": 4, "train.learning_rate": 2e-3,
        "train.sigma.sampling": "uniform", "train.max_steps": 4, "train.checkpoint_every": 100,
        "train.on_damaged": "skip", "train.max_damaged_fraction": 1.0}), store, model, out)
    print(f"RESULT damaged_steps: {result.damaged_steps}", flush=True)
    print(f"RESULT line: {result}", flush=True)


if __name__ == "__main__":
    main()
