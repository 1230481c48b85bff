"""Run by each of two gloo processes (tests/stages/test_rank_write_fails.py, not a test module itself): a rank's
own file write fails on a full disk on one rank only; `recipe.run` is called directly (no CLI top level that
would publish the error for it), a one-line error printed as the CLI prints it (`error: LINE`, status 1).

    rank_write_fails.py trace STORE MODEL OUT     rank 1's profiler trace (train.profile=1) hits a full disk
    rank_write_fails.py damaged STORE MODEL OUT   the damaged-sample list of the rank that meets the store's one
                                                  damaged sample hits a full disk (one epoch: one rank meets it)
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

from pipeline.config import load_config
from schemas.errors import UserError


def _full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def main() -> None:
    case, store, model, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    from stages.train import damaged_log, recipe

    train = {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.max_steps": 2,
             "train.checkpoint_every": 100}
    if case == "trace":
        train["train.profile"] = 1
        if os.environ["RANK"] == "1":
            import torch.profiler

            torch.profiler.profile.export_chrome_trace = _full
    else:
        train["train.on_damaged"] = "skip"
        train["train.max_damaged_fraction"] = 0.5
        damaged_log.append = _full  # only the rank that meets the damaged sample appends
    try:
        recipe.run(load_config(None, train), store, model, out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
