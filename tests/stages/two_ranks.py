"""Two gloo processes started directly with the launcher's environment (so each one's output is its own): the
one way the rank tests launch a script on ranks 0 and 1 and collect (exit status, stdout, stderr) of each."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launch_ports import start_host_first
from warm_start import WarmProcess, outcomes

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def start_two(script: str, *args: str, env: dict[str, str] | None = None) -> list[WarmProcess]:
    """Start tests/stages/`script` with `args` as ranks 0 and 1 of one gloo world (`env` added to both), each a
    new process started warm (tests/warm_start.py). Rank 0 hosts the store (a plain env:// launch): rank 1 starts
    once it listens (tests/launch_ports.py)."""
    def start(rank: int, port: int) -> WarmProcess:
        full = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), str(HERE.parent)]), **(env or {})}
        return WarmProcess([sys.executable, str(HERE / script), *args], env=full)

    return start_host_first(start, 2)


def launch_two(script: str, *args: str, timeout: float = 420) -> list[tuple[int, str, str]]:
    """Run tests/stages/`script` with `args` as ranks 0 and 1 of one gloo world (`start_two`). A rank left waiting
    in a collective hangs: the timeout then fails the test (no timing assert: a bound, generous under load)."""
    return outcomes(start_two(script, *args), timeout)


def results(output: str) -> dict[str, str]:
    """The `RESULT name: line` lines a rank script prints."""
    return dict(line[len("RESULT "):].split(": ", 1) for line in output.splitlines() if line.startswith("RESULT "))
