"""Run by each of two gloo processes (tests/stages/test_encode_uneven_ranks.py, not a test module itself):
`pipeline run encode-vae` whose rank 1 ends its share long after rank 0 (a share of the samples new since the last
encode, a slower node). Rank 0 marks the end of its share in MARKER; rank 1 waits for that mark, then either takes
DELAY more seconds or is killed without a word. From its mark on, rank 0's process group times out after TIMEOUT s
(NCCL's default is 10 minutes: a multi-hour encode's ranks end further apart than that). Exit status and output
are the test's.

    rank_uneven_encode.py late STORE MODEL MARKER TIMEOUT DELAY
    rank_uneven_encode.py killed STORE MODEL MARKER LOST       rank 1 SIGKILLed; LOST: collective.LOST_SECONDS
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

RANK = int(os.environ["RANK"])


def main() -> None:
    case, store, model, marker, *numbers = sys.argv[1:]
    marker, numbers = Path(marker), [float(n) for n in numbers]
    from models import collective
    from pipeline.cli import main as cli
    from stages.encode import commit

    real = commit.finish

    def finish(job):
        if RANK == 0:
            marker.write_text("rank 0 ended its share")
            if case == "late":
                import torch.distributed as dist

                dist.set_timeout(timedelta(seconds=numbers[0]))
            return real(job)
        deadline = time.monotonic() + 240
        while not marker.exists():  # rank 0 is at the end of its share (or past it) before rank 1 goes on
            if time.monotonic() > deadline:
                raise SystemExit("rank 0 never marked the end of its share")
            time.sleep(0.1)
        if case == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(numbers[1])  # rank 1's share ends this much later: rank 0 waits at least that long
        return real(job)

    commit.finish = finish
    if case == "killed":
        collective.LOST_SECONDS = numbers[0]
    sys.argv = ["pipeline", "run", "encode-vae", "--store", store, "--model", model, "--device", "cpu"]
    cli()


if __name__ == "__main__":
    main()
