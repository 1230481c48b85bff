"""Run by each of two gloo processes (tests/stages/test_rank_stale_view.py, not a test module itself): `pipeline
run train --resume` where rank 1 does not see the run folder's newest checkpoint yet (a shared filesystem whose
directory cache lags on its node: its listing ends one checkpoint earlier). Exit status and output are the test's.

    rank_stale_view.py STORE MODEL OUT MAX_STEPS
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    store, model, out, steps = sys.argv[1:5]
    from pipeline.cli import main as cli
    from stages.train import state as train_state

    if os.environ["RANK"] == "1":
        real = train_state.complete_checkpoints
        train_state.complete_checkpoints = lambda root: real(root)[:-1]  # the newest not listed yet
    sys.argv = ["pipeline", "run", "train", "--store", store, "--model", model, "--out", out, "--device", "cpu",
                "--max-steps", steps, "--batch-size", "2", "--set", "train.lora.rank=4", "--set",
                "train.checkpoint_every=2", "--resume"]
    cli()


if __name__ == "__main__":
    main()
