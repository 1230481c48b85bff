"""Run by each of two gloo processes (tests/stages/test_validation_fails_alone.py, not a test module itself): the
work only rank 0 does during validation fails there, through the CLI (exit status and output are the test's):

    rank_validation_fails.py samples-oom STORE MODEL OUT   rank 0 runs out of memory generating the sample grid
                                                           (rank 1 goes on to the next step's all-reduce)
    rank_validation_fails.py record-disk-full STORE MODEL OUT  rank 0 finds the disk full appending to
                                                           RUN/losses.zarr
    rank_validation_fails.py samples-wait STORE MODEL OUT  no failure: rank 0's sample grid looks (for 10 s)
                                                           whether rank 1 went on into the next step meanwhile
                                                           (RESULT went_on: True/False)
"""

from __future__ import annotations

import errno
import os
import sys

import torch

RANK = int(os.environ["RANK"])


def main() -> None:
    case, store, model, out = sys.argv[1:5]
    from pipeline.cli import main as cli
    from stages.train.validate import Validator

    if RANK == 0 and case == "samples-oom":
        def samples_grid(self, transformer):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB (test)")

        Validator.samples_grid = samples_grid
    if RANK == 0 and case == "record-disk-full":
        def record(self, step, grid):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.run_dir / "losses.zarr"))

        Validator.record = record
    if case == "samples-wait":
        import time
        from pathlib import Path

        from stages.train import recipe

        marker = Path(out).parent / "rank-1-went-on"
        if RANK == 1:
            real_step = recipe.step

            def step(r):
                if r.step == 2:  # after the validation of step 2: the next step
                    marker.touch()
                return real_step(r)

            recipe.step = step
        else:
            real_grid = Validator.samples_grid

            def samples_grid(self, transformer):
                deadline = time.monotonic() + 10
                while not marker.exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
                print(f"RESULT went_on: {marker.exists()}", flush=True)
                return real_grid(self, transformer)

            Validator.samples_grid = samples_grid
    sys.argv = ["pipeline", "run", "train", "--store", store, "--model", model, "--out", out, "--device", "cpu",
                "--max-steps", "3", "--batch-size", "2", "--set", "train.lora.rank=4", "--set",
                "train.sample_every=2", "--set", "train.validate_every=2", "--set", "train.sample_count=1",
                "--set", "train.validate_max_samples=2", "--set", "train.sample_steps=2", "--set", "train.checkpoint_every=1"]
    cli()


if __name__ == "__main__":
    main()
