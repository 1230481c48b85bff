"""Run by each of two gloo processes (tests/stages/test_computed_on_ranks.py, not a test module itself): every
rank's machine gathered by `loss_groups.on_every_rank`, rank 1's holding LIBRARIES libraries with long versions
(a JSON text of ~20 KB, far above the 4096 bytes a rank's text once had), rank 0's a usual one. Prints
`RESULT machines: <JSON of what this rank gathered>`.

    computed_on_ranks.py LIBRARIES
"""

from __future__ import annotations

import json
import os
import sys

from schemas.config import EvaluateConfig
from stages.evaluate.loss_groups import on_every_rank
from stages.evaluate.ranks import launched


def main() -> None:
    many = int(sys.argv[1])
    ranks = launched(EvaluateConfig(device="cpu"))
    libraries = {"torch": "2.5.1"} if ranks.main else {f"library_{i:03d}": f"{i}.0.0+é{'x' * 150}" for i in
                                                        range(many)}
    mine = {"device": ["cpu", [""]], "libraries": libraries, "sources": "not gathered"}
    print(f"RESULT machines: {json.dumps(on_every_rank(ranks.world, mine))}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
