"""Run by each of two gloo processes (tests/stages/test_train_preempted.py, not a test module itself): `pipeline
ARGS...` through the CLI's own entry point, where rank 1 alone is sent SIGTERM as its `N`-th micro-batch's backward
begins (`recipe.backward_of`); each rank prints how many micro-batches it ran (`RESULT micro-batches: K`).

    rank_stop_mid_step.py N ARGS...
"""

from __future__ import annotations

import os
import signal
import sys


def main() -> None:
    from pipeline.cli import main as cli
    from stages.train import recipe

    signal_at, real, calls = int(sys.argv[1]), recipe.backward_of, []

    def counted(*a, **k):
        calls.append(1)
        if os.environ["RANK"] == "1" and len(calls) == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    recipe.backward_of = counted
    sys.argv = ["pipeline", *sys.argv[2:]]
    try:
        cli()
    finally:
        print(f"RESULT micro-batches: {len(calls)}", flush=True)


if __name__ == "__main__":
    main()
