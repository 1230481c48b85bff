"""Run by each of two gloo processes (tests/stages/test_skip_damaged_ranks.py, not a test module itself):
train.on_damaged=skip on a store with one damaged sample, which one rank meets in its share. `ok`: both ranks
train to the end; `limit` (max_damaged_fraction 0): both stop with the same line. Each case's outcome is
printed as `RESULT <case>: <text>`.

    skip_damaged_ranks.py STORE MODEL OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.config import load_config
from schemas.errors import UserError


def main() -> None:
    store, model, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    from stages.train import recipe

    train = {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.learning_rate": 2e-3,
             "train.sigma.sampling": "uniform", "train.max_steps": 2, "train.checkpoint_every": 100,
             "train.on_damaged": "skip"}
    for case, fraction in (("ok", 0.2), ("limit", 0.0)):
        try:
            result = recipe.run(load_config(None, {**train, "train.max_damaged_fraction": fraction}), store, model,
                                out / case)
            print(f"RESULT {case}: steps {result.steps}", flush=True)
        except UserError as e:
            print(f"RESULT {case}: {e}", flush=True)


if __name__ == "__main__":
    main()
