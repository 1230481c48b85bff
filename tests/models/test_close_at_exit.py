"""`models.collective.close_at_exit`: a launched rank closes its process group before the interpreter finalizes.

Left to finalization, a rank that exits while gloo's worker threads still run its last collectives died of
SIGABRT ("terminate called without an active exception") after its last line: a failed rank's exit 1 read as -6
(`test_launch_cli`'s failed launch, seen in CI). Two real ranks under torchrun on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Rank 0 starts 20 all-reduces and leaves without waiting for them; rank 1 joins them only after a while.
SCRIPT = """
import sys, time
import torch, torch.distributed as dist
from models import collective
dist.init_process_group("gloo")
collective.close_at_exit()
collective.timing.CLOSE_SECONDS = float(sys.argv[2])
if dist.get_rank() == 0:
    works = [dist.all_reduce(torch.ones(4096), async_op=True) for _ in range(20)]
    print("rank 0 leaves", flush=True)
else:
    time.sleep(float(sys.argv[1]))
    for i in range(20):
        dist.all_reduce(torch.ones(4096))
    print("rank 1 finished its 20 all-reduces", flush=True)
"""


def _launch(tmp_path: Path, joins_after: float, close_seconds: float) -> subprocess.CompletedProcess:
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        # --standalone: a free port (torchrun's default 29500 may be another test's on a shared machine)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
         str(joins_after), str(close_seconds)], env=env, capture_output=True, text=True, timeout=120)


def test_a_rank_leaving_with_collectives_in_flight_closes_its_group_and_exits_0(tmp_path) -> None:
    """Before: rank 0 exited at once (its pending all-reduces dropped: rank 1's failed with "Connection closed by
    peer") or aborted mid-finalization (-6). Now its exit waits for them: both ranks end 0, every all-reduce done."""
    p = _launch(tmp_path, joins_after=1.0, close_seconds=60)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rank 0 leaves" in p.stdout and "rank 1 finished its 20 all-reduces" in p.stdout, p.stdout + p.stderr[-3000:]
    assert "terminate called" not in p.stderr and "Connection closed" not in p.stderr, p.stderr[-3000:]


def test_a_group_that_cannot_close_ends_the_rank_with_one_line(tmp_path) -> None:
    """A peer stuck elsewhere (here: asleep far past the deadline) never joins rank 0's collectives: rank 0 waits
    CLOSE_SECONDS, then ends with status 1 and one line saying why, instead of waiting out the collective timeout."""
    p = _launch(tmp_path, joins_after=60.0, close_seconds=1)
    assert p.returncode != 0
    lines = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert lines == ["error: this rank's process group did not close within 1 s at exit (another rank is stuck in "
                     "a collective): ending this process"], p.stderr[-3000:]
    assert "exitcode: 1" in p.stderr or "exitcode  : 1" in p.stderr, p.stderr[-3000:]


# One rank (a group of one) whose interpreter refuses to start a thread in an atexit callback, as Python
# 3.12.0-3.12.1 do ("can't create new thread at interpreter shutdown"); the first atexit callback registered runs
# last and says whether the group is still open then.
REFUSING_SCRIPT = """
import atexit, sys, threading
import torch.distributed as dist
from models import collective
atexit.register(lambda: print("group open after the exit:", dist.is_initialized(), flush=True))
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
collective.close_at_exit()

def refuse(self):
    raise RuntimeError("can't create new thread at interpreter shutdown")

atexit.register(setattr, threading.Thread, "start", refuse)
"""


def test_the_group_closes_where_an_atexit_callback_cannot_start_a_thread(tmp_path) -> None:
    """Before: the close started its deadline thread in the atexit callback; on Python 3.12.0-3.12.1 (the
    rehearsal of the GPU machine's stack) that raised, the group was left to finalization (the SIGABRT this close
    exists for) and a traceback was printed. Now the thread waits from close_at_exit on."""
    script = tmp_path / "one_rank.py"
    script.write_text(REFUSING_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "group")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "group open after the exit: False" in p.stdout, p.stdout + p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
