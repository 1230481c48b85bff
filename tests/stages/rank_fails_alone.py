"""Run by each of two gloo processes (tests/stages/test_rank_fails_alone.py, not a test module itself): rank 1
fails where the other rank does not wait for it in an agreement, through the CLI (its exit status and output
are the test's):

    rank_fails_alone.py train-oom STORE MODEL OUT R one rank (R) runs out of memory inside its backward (the
                                                    other then sits in DDP's gradient all-reduce, which never
                                                    completes); rank 0 also serves the launch's store
    rank_fails_alone.py train-optimizer-oom STORE MODEL OUT R  rank R runs out of memory in its optimizer's
                                                    step (Adam's state, allocated at the first step), after the
                                                    backward: the other goes on to the next step's all-reduce
    rank_fails_alone.py train-interrupt STORE MODEL OUT R  a Ctrl-C (SIGINT) reaches rank R alone in its first
                                                    step's forward: the other sits in DDP's all-reduce
    rank_fails_alone.py encode-open STORE MODEL     rank 1 cannot open encode-vae's inputs (before any
                                                    collective)
    rank_fails_alone.py encode-devices STORE MODEL  one device listed for two processes: only local rank 1 has
                                                    none (before any collective)
    rank_fails_alone.py encode-skip STORE MODEL F   encode-vae with on_damaged=skip, max_damaged_fraction F
    rank_fails_alone.py train-locked STORE MODEL OUT train into a run folder another process is writing: only
                                                    rank 0 takes the run folder's lock, so only rank 0 is refused
"""

from __future__ import annotations

import os
import sys
import types

import torch

RANK = int(os.environ["RANK"])


class _OutOfMemoryInBackward(torch.autograd.Function):
    """Identity forward; its backward fails as a CUDA allocation does."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")


def main() -> None:
    case, store, model = sys.argv[1:4]
    from pipeline.cli import main as cli

    if case == "train-oom":
        from stages.train import recipe

        real = recipe.flow_loss_of
        if RANK == int(sys.argv[5]):
            recipe.flow_loss_of = lambda *a, **k: _OutOfMemoryInBackward.apply(real(*a, **k))
        sys.argv = ["pipeline", "run", "train", "--store", store, "--model", model, "--out", sys.argv[4],
                    "--device", "cpu", "--max-steps", "2", "--batch-size", "2", "--set", "train.lora.rank=4"]
    elif case == "train-optimizer-oom":
        from stages.train import optimizers

        real_build = optimizers.build_optimizer

        def build(*a, **k):
            optimizer = real_build(*a, **k)

            def step(self, *_a, **_k):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB (test)")

            optimizer.step = types.MethodType(step, optimizer)  # bound: the LR scheduler wraps it (`__func__`)
            return optimizer

        if RANK == int(sys.argv[5]):
            optimizers.build_optimizer = build
        sys.argv = ["pipeline", "run", "train", "--store", store, "--model", model, "--out", sys.argv[4],
                    "--device", "cpu", "--max-steps", "2", "--batch-size", "2", "--set", "train.lora.rank=4"]
    elif case == "train-interrupt":
        import signal

        from stages.train import recipe

        real = recipe.flow_loss_of

        def interrupted(*a, **k):
            os.kill(os.getpid(), signal.SIGINT)  # the CLI's handler raises KeyboardInterrupt here, as on a Ctrl-C
            return real(*a, **k)

        if RANK == int(sys.argv[5]):
            recipe.flow_loss_of = interrupted
        sys.argv = ["pipeline", "run", "train", "--store", store, "--model", model, "--out", sys.argv[4],
                    "--device", "cpu", "--max-steps", "2", "--batch-size", "2", "--set", "train.lora.rank=4"]
    elif case == "encode-devices":
        sys.argv = ["pipeline", "run", "encode-vae", "--store", store, "--model", model,
                    "--set", "encode_vae.device=[cpu]"]
    elif case == "encode-skip":  # sys.argv[4]: encode_vae.max_damaged_fraction
        sys.argv = ["pipeline", "run", "encode-vae", "--store", store, "--model", model, "--device", "cpu",
                    "--set", "encode_vae.on_damaged=skip", "--set", f"encode_vae.max_damaged_fraction={sys.argv[4]}"]
    elif case == "train-locked":
        sys.argv = ["pipeline", "run", "train", "--store", store, "--model", model, "--out", sys.argv[4],
                    "--device", "cpu", "--max-steps", "2", "--batch-size", "2", "--set", "train.lora.rank=4"]
    else:
        from schemas.errors import UserError
        from stages.encode import plan

        def refused(*a, **k):
            raise UserError("rank 1 cannot hold a read lease on the images table (test)")

        if RANK == 1:
            plan.hold = refused
        sys.argv = ["pipeline", "run", "encode-vae", "--store", store, "--model", model, "--device", "cpu"]
    cli()


if __name__ == "__main__":
    main()
