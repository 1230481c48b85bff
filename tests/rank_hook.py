"""`pipeline launch` of 2 CPU ranks with a `sitecustomize.py` each rank imports first: the tests' way to make one
rank misbehave (see a GPU, kill itself) inside the real launcher, with no test code in the product."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import warm_start

REPO = Path(__file__).resolve().parents[1]


def launch_with_hook(tmp_path: Path, sitecustomize: str, args: list[str], timeout: int) -> subprocess.CompletedProcess:
    """`pipeline launch --standalone --nproc-per-node 2 ARGS` with `sitecustomize` on every rank's path (the
    launcher's own process has no RANK: a hook reads it to pick its rank). Launcher and ranks start warm
    (tests/warm_start.py; a warm start runs a sitecustomize on its PYTHONPATH as a cold one does)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(sitecustomize)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(REPO)]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    return warm_start.run([sys.executable, "-m", "pipeline.cli", "launch", "--standalone", "--nproc-per-node", "2",
                           *args], env=env, timeout=timeout)
