"""`bench/rehearsal.py` at --layers 1 on the CPU, as the tests run it: the full-width model folder, its store
encoded and one int8 training step (tests/pipeline/test_rehearsal.py, tests/models/test_tiny_model_21.py). The
bench's own process starts warm (tests/warm_start.py: torch and diffusers imported already); each run it measures
is still a fresh process of its own, as the bench starts it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import warm_start

REPO = Path(__file__).resolve().parents[1]


def rehearse(work: Path, *args: str) -> list[dict]:
    """The runs `bench/rehearsal.py --layers 1 --area 4096 --samples 2 --steps 1 --quantize int8
    --minimal-text-encoder --work WORK ARGS` wrote (it must exit 0)."""
    out = work / "r.json"
    # one thread per process: on the shared 2-core machine more threads only spin against other jobs (this
    # command: 33 s wall at one thread; 58-85 s with the default threads under a load average of ~3-4)
    # the suite's own PYTHONPATH after the repo: a stack installed with `pip --target` (the GPU machine's,
    # bench/gpu/rehearse) has its libraries only there, and the bench's runs are fresh processes
    paths = [str(REPO), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
    proc = warm_start.run(
        [sys.executable, str(REPO / "bench" / "rehearsal.py"), "--layers", "1", "--area", "4096", "--samples", "2",
         "--steps", "1", "--quantize", "int8", "--minimal-text-encoder", "--work", str(work / "w"),
         "--out", str(out), *args], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())
