"""Run by each of two gloo processes (tests/stages/test_uneven_ranks.py, not a test module itself): rank 1 comes to
an agreement long after rank 0. Rank 0 marks in MARKER that it has come there; rank 1 waits for that mark, then
takes DELAY more seconds (or is killed without a word). From its mark until the agreement is over, rank 0's process
group times out after TIMEOUT s (NCCL's default is 10 minutes: a multi-hour encode's shares, or a node loading the
model from a slower disk, end further apart than that). Exit status and output are the test's.

    rank_uneven.py encode-late STORE MODEL MARKER TIMEOUT DELAY       `run encode-vae`: rank 1 ends its share late
    rank_uneven.py encode-killed STORE MODEL MARKER LOST              ... rank 1 SIGKILLed instead; LOST:
                                                                      collective.timing.LOST_SECONDS
    rank_uneven.py train-load STORE MODEL MARKER TIMEOUT DELAY OUT    `run train`: rank 1 loads the model late
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

RANK = int(os.environ["RANK"])


def _after_rank_0(marker: Path) -> None:
    deadline = time.monotonic() + 240
    while not marker.exists():  # rank 0 has come to the agreement (or is past it) before rank 1 goes on
        if time.monotonic() > deadline:
            raise SystemExit("rank 0 never marked that it came to the agreement")
        time.sleep(0.1)


def _timeout(seconds: float | None) -> None:
    """Rank 0's process-group timeout: `seconds`, or back to torch's default for gloo."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    dist.set_timeout(timedelta(seconds=seconds) if seconds is not None else default_pg_timeout)


def main() -> None:
    case, store, model, marker, *rest = sys.argv[1:]
    marker = Path(marker)
    numbers = [float(n) for n in rest[:2]]
    from models import collective
    from pipeline.cli import main as cli

    if case.startswith("encode"):
        from stages.encode import commit

        real = commit.finish

        def finish(job):
            if RANK == 0:
                marker.write_text("rank 0 ended its share")
                if case == "encode-late":
                    _timeout(numbers[0])
                    agree = collective.agree._agree

                    def agree_once(*args, **kwargs):  # the agreement rank 1 comes late to; then the default
                        try:
                            return agree(*args, **kwargs)
                        finally:
                            collective.agree._agree = agree
                            _timeout(None)

                    collective.agree._agree = agree_once
                return real(job)
            _after_rank_0(marker)
            if case == "encode-killed":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(numbers[1])  # rank 1's share ends this much later: rank 0 waits at least that long
            return real(job)

        commit.finish = finish
        if case == "encode-killed":
            collective.timing.LOST_SECONDS = numbers[0]
        sys.argv = ["pipeline", "run", "encode-vae", "--store", store, "--model", model, "--device", "cpu"]
    else:
        from models import loading
        from stages.train import build

        load, backend = loading.load_component, build.use_attention_backend

        def load_component(model_dir, component, *args, **kwargs):
            if component != "transformer":
                return load(model_dir, component, *args, **kwargs)
            if RANK == 0:
                out = load(model_dir, component, *args, **kwargs)
                marker.write_text("rank 0 loaded the model")
                _timeout(numbers[0])
                return out
            _after_rank_0(marker)
            time.sleep(numbers[1])  # rank 1's node reads the model this much later
            return load(model_dir, component, *args, **kwargs)

        def use_attention_backend(*args, **kwargs):
            if RANK == 0:
                _timeout(None)  # the agreement on the load is over: training runs under the default
            return backend(*args, **kwargs)

        loading.load_component, build.use_attention_backend = load_component, use_attention_backend
        sys.argv = ["pipeline", "run", "train", "--store", store, "--model", model, "--out", rest[2], "--device", "cpu",
                    "--max-steps", "2", "--batch-size", "2", "--set", "train.lora.rank=4"]
    cli()


if __name__ == "__main__":
    main()
