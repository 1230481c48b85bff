"""Run by each of two gloo processes (tests/stages/test_evaluate_val_share.py, not a test module itself):
`evaluate --all-checkpoints` with the joined rows each rank reads counted (`JoinedTables.features_at`), printed
as `RESULT rows: [...]`.

    val_share_ranks.py STORE RUN OUT SETTINGS_JSON MODEL
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from schemas.config import EvaluateConfig
from stages.evaluate import checkpoints as ev
from store.join import JoinedTables


def main() -> None:
    store, run, out, settings, model = sys.argv[1:6]
    read: list[int] = []
    features_at = JoinedTables.features_at

    def counted(self, i: int):
        read.append(int(i))
        return features_at(self, i)

    JoinedTables.features_at = counted
    from stages.evaluate import val_share

    val_share._share_masks.__defaults__ = (2,)  # masks sent 2 samples at a time: chunk boundaries exercised
    ckpts = [(s, Path(run) / "checkpoints" / f"step-{s}" / "lora") for s in (10, 20, 30)]
    ev.run(EvaluateConfig(**json.loads(settings)), store, model, ckpts, out)
    print(f"RESULT rows: {json.dumps(read)}", flush=True)


if __name__ == "__main__":
    main()
