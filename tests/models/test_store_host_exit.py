"""The rank that serves a plain env:// launch's store (rank 0) ends after every other rank has stopped using it.

Seen in CI: both ranks of an agreed refusal printed the same line, rank 0 ended at once, and rank 1, whose exit came
a moment later on the loaded machine, had its watch thread (`models.collective.watch_failures`) poll the store that
had just gone: torch's client printed a C++ warning and an 18-frame stack after the rank's last line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launch_ports import start_host_first
from warm_start import WarmProcess, outcomes

REPO = Path(__file__).resolve().parents[2]

# Both ranks refuse together; rank 1 then lingers (a loaded node's slow exit) while its watch thread polls.
SCRIPT = """
import sys, time
import torch.distributed as dist
from models import collective
from schemas.errors import UserError
dist.init_process_group("gloo")
collective.close_at_exit()
try:
    with collective.together(2, "the check"):
        raise UserError("refused on every rank")
except UserError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
if dist.get_rank() == 1:
    time.sleep(3 * collective.timing.POLL_SECONDS + 1)
sys.exit(1)
"""


def test_the_store_host_outlives_the_others_use_of_the_store(tmp_path) -> None:
    script = tmp_path / "refuse_together.py"
    script.write_text(SCRIPT)

    def start(rank: int, port: int) -> WarmProcess:
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO)}
        return WarmProcess([sys.executable, str(script)], env=env)

    (rc0, _, err0), (rc1, _, err1) = outcomes(start_host_first(start, 2), timeout=120)
    assert rc0 == rc1 == 1, (rc0, rc1, err0[-3000:], err1[-3000:])
    for err in (err0, err1):
        assert err.strip().splitlines()[-1] == "error: refused on every rank", err[-3000:]
        assert "frame #" not in err and "Connection was likely closed" not in err, err[-3000:]
