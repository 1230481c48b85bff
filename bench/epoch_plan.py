"""Memory and build time of one epoch plan per rank (`stages/train/sampler.py`, `budget.py`) at scale.

Each rank plans the whole epoch (every rank's batches: DataStream and the check-ahead walkers read it), and keeps
two plans (`DataStream.KEPT_PLANS`). Measured with tracemalloc (numpy reports its buffers to it): the bytes the
plan holds once built, and the peak while building it, in a fresh process per sampler.

    python bench/epoch_plan.py --samples 1000000 --world-size 8
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import tracemalloc


def measure(kind: str, samples: int, world_size: int) -> dict:
    import numpy as np

    from stages.train.budget import TokenBudgetBatchSampler
    from stages.train.sampler import LengthAwareBatchSampler

    rng = random.Random(0)
    lengths = np.array([rng.choice([1024, 2304, 4096, 6144, 8192]) + rng.randint(0, 300) for _ in range(samples)])
    if kind == "length":
        sampler = LengthAwareBatchSampler(lengths, 4, seed=0, window=64, world_size=world_size)
    else:
        sampler = TokenBudgetBatchSampler(lengths, 16384, seed=0, window=64, world_size=world_size)
    t0 = time.perf_counter()
    plan = sampler.global_steps(0)
    seconds = time.perf_counter() - t0  # without tracemalloc, which slows allocations down
    del plan
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    plan = sampler.global_steps(0)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"sampler": kind, "samples": samples, "world_size": world_size, "steps": len(plan),
            "plan_mb": round((held - base) / 2**20, 1), "build_peak_mb": round((peak - base) / 2**20, 1),
            "build_s": round(seconds, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--one", choices=["length", "budget"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.one, a.samples, a.world_size)))
        return
    for kind in ("length", "budget"):  # a fresh process each: no allocator state carried over
        subprocess.run([sys.executable, __file__, "--one", kind, "--samples", str(a.samples),
                        "--world-size", str(a.world_size)], check=True)


if __name__ == "__main__":
    main()
