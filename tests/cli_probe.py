"""`pipeline` commands run in one cold interpreter, with which heavy modules each had loaded by then: the tests
of what a command's start costs (tests/store/test_store_cold_start.py, tests/pipeline/test_cli_startup.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "diffusers", "transformers", "bitsandbytes", "peft", "torchao", "accelerate", "safetensors")

# Each command in turn, in one interpreter (one cold start for all): its exit status and which heavy modules it
# had loaded by then (a module once loaded stays: a later command's list includes an earlier one's). Keyed as
# `key` names them.
PROBE = """
import json, sys
from pipeline.cli import app
added = {}
for words, key in zip(*json.loads(sys.argv[1])):
    try:
        code = app(words, prog_name="pipeline", standalone_mode=False)  # typer.Exit(n): returned
    except SystemExit as e:
        code = e.code
    added[key] = [code or 0, sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)]
print("ADDED", json.dumps(added))
"""


def keys(commands: list[list[str]]) -> list[str]:
    """Each command's key in `run_each`'s answer: its first two words, then ` #2`, ` #3` for a repeat of them."""
    out: list[str] = []
    for words in commands:
        key = " ".join(words[:2])
        seen = sum(k.split(" #")[0] == key for k in out)
        out.append(f"{key} #{seen + 1}" if seen else key)
    return out


def run_each(commands: list[list[str]]) -> tuple[dict, subprocess.CompletedProcess]:
    """{key (`keys`): [exit status, heavy modules loaded]} of `commands` run in one process, and the process."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps([commands, keys(commands)]), json.dumps(HEAVY)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ADDED" in proc.stdout, proc.stderr[-3000:]
    return json.loads(proc.stdout.rsplit("ADDED", 1)[1]), proc
