"""Run by each of two gloo processes (tests/stages/test_rank_nonfinite.py, not a test module itself): a sample
whose stored target holds inf makes the step's loss non-finite on the one rank that trains it. Both ranks decide
alike (the loss is all-reduced); the line each one ends with must name that sample, whichever rank held it.

    rank_nonfinite.py STORE MODEL OUT     prints `RESULT stop: <line>` (train.on_nonfinite=stop), then trains
                                          with skip_step (its `skipped ...` lines are the test's)
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.config import load_config
from schemas.errors import UserError


def main() -> None:
    store, model, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    from stages.train import recipe

    train = {"train.device": "cpu", "train.batch_size": 1, "train.lora.rank": 4, "train.max_steps": 2,
             "train.checkpoint_every": 100}
    try:
        recipe.run(load_config(None, train), store, model, out / "stop")
        print("RESULT stop: no error", flush=True)
    except UserError as e:
        print("RESULT stop: " + " ".join(str(e).splitlines()), flush=True)
    result = recipe.run(load_config(None, {**train, "train.on_nonfinite": "skip_step"}), store, model, out / "skip")
    print(f"RESULT skipped: {result.skipped_steps}", flush=True)


if __name__ == "__main__":
    main()
