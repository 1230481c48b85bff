"""Run by each of two gloo processes (tests/stages/test_shared_out.py, not a test module itself): `pipeline run
train` with the `--out` OUT/<node> the test gives each rank (the same path on two nodes' own disks, simulated by
two folders), then with one folder for both. Prints `RESULT <case>: <exit status> <last line>`.

    shared_out_ranks.py STORE MODEL OUT_RANK0 OUT_RANK1
"""

from __future__ import annotations

import os
import sys

from typer.testing import CliRunner

from pipeline.cli import app

RANK = int(os.environ["RANK"])
store, model, out0, out1 = sys.argv[1:5]
res = CliRunner().invoke(app, ["run", "train", "--store", store, "--model", model, "--out", (out0, out1)[RANK],
                               "--set", "train.max_steps=1", "--set", "train.device=cpu"])
lines = res.output.strip().splitlines()
print(f"RESULT apart: {res.exit_code} {lines[-1] if lines else ''}", flush=True)
if res.exception is not None and not isinstance(res.exception, SystemExit):
    import traceback

    traceback.print_exception(res.exception)
