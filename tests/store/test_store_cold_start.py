"""The store's commands that read no tensor start without the model stack, torch included: each cold process (a
user's `pipeline store inspect`, every subprocess of the suite) paid torch's import (~1.6 s idle, several seconds
on a loaded machine) for nothing. What they import is checked, not how long it takes (bench/cold_start.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from store import Store
from store_samples import fill

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "diffusers", "transformers", "bitsandbytes", "peft", "torchao", "accelerate", "safetensors")

# Each command in turn, in one interpreter (one cold start for all): which heavy modules each one added.
PROBE = """
import json, sys
from pipeline.cli import app
added = {}
for words in json.loads(sys.argv[1]):
    try:
        app(words, prog_name="pipeline", standalone_mode=False)
    except SystemExit as e:
        assert not e.code, (words, e.code)
    added[" ".join(words[:2])] = sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)
print("ADDED", json.dumps(added))
"""


def test_store_commands_import_no_model_stack(tmp_path):
    store = tmp_path / "store"
    fill(Store(store, create=True), 6)  # tensors (bf16, float32) and files: verify checks every tensor's size
    s = str(store)
    commands = [["store", "inspect", s], ["store", "verify", s], ["store", "gc", s, "--dry-run"],
                ["store", "repair", s, "--dry-run"]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(commands), json.dumps(HEAVY)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verified" in proc.stdout, proc.stdout[-2000:]  # verify read every shard (not an early refusal)
    added = json.loads(proc.stdout.rsplit("ADDED", 1)[1])
    assert added == {"store inspect": [], "store verify": [], "store gc": [], "store repair": []}
