"""Run by each of two gloo processes (tests/stages/test_shared_out.py, not a test module itself): `pipeline run
train` with the `--out` the test gives each rank (the same path on two nodes' own disks, simulated by two
folders), then `pipeline run encode-vae` with a store folder per rank likewise. Prints `RESULT <case>: <exit
status> <its error lines>`.

    shared_out_ranks.py STORE MODEL OUT_RANK0 OUT_RANK1 IMAGES_STORE_RANK0 IMAGES_STORE_RANK1
"""

from __future__ import annotations

import os
import sys

from typer.testing import CliRunner

from pipeline.cli import app
from schemas import view_lag

RANK = int(os.environ["RANK"])
# rank 1 never sees rank 0's probe here (two folders): its refusal after 0.3 s of looking, not the minute a lagging
# view of a shared folder is given (schemas/view_lag.py)
view_lag.VIEW_LAG_WAITS_S, view_lag.VIEW_LAG_SECONDS = (0.1, 0.2), 0.3
store, model, out0, out1, images0, images1 = sys.argv[1:7]


def case(name: str, args: list[str]) -> None:
    res = CliRunner().invoke(app, args)
    errors = [line for line in res.output.splitlines() if line.startswith("error: ")]
    print(f"RESULT {name}: {res.exit_code} {' | '.join(errors)}", flush=True)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        import traceback

        traceback.print_exception(res.exception)
    # a launched rank prints one failure line per process (`report_once` keeps its lock while the rank watches the
    # others); a real process runs one command, this script two: the next case's line is its own
    import threading

    import models.collective as collective

    collective.state.report_lock = threading.Lock()


case("train", ["run", "train", "--store", store, "--model", model, "--out", (out0, out1)[RANK],
               "--set", "train.max_steps=1", "--set", "train.device=cpu"])
case("encode", ["run", "encode-vae", "--store", (images0, images1)[RANK], "--model", model, "--device", "cpu"])
