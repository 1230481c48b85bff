"""Run by each of two gloo processes (tests/stages/test_evaluate_val_share.py, not a test module itself):
`evaluate --all-checkpoints` once per job, one after another in the same two processes (one launch for the
module's cases: each launch costs seconds of imports per rank), with the joined rows each rank reads in each job
counted (`JoinedTables.features_at`), printed as `RESULT rows<job>: [...]`.

    val_share_ranks.py RUN MODEL JOBS_JSON    (JOBS_JSON: [[store, out, settings], ...])
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from schemas.config import EvaluateConfig
from stages.evaluate import checkpoints as ev
from store.join import JoinedTables


def main() -> None:
    run, model, jobs = sys.argv[1:4]
    read: list[int] = []
    features_at = JoinedTables.features_at

    def counted(self, i: int):
        read.append(int(i))
        return features_at(self, i)

    JoinedTables.features_at = counted
    from stages.evaluate import val_share

    val_share._share_masks.__defaults__ = (2,)  # masks sent 2 samples at a time: chunk boundaries exercised
    ckpts = [(s, Path(run) / "checkpoints" / f"step-{s}" / "lora") for s in (10, 20, 30)]
    for job, (store, out, settings) in enumerate(json.loads(jobs)):
        read.clear()
        ev.run(EvaluateConfig(**settings), store, model, ckpts, out)
        print(f"RESULT rows{job}: {json.dumps(read)}", flush=True)


if __name__ == "__main__":
    main()
