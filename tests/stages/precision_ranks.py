"""Run by each of two gloo processes (tests/stages/test_precision_ranks.py, not a test module itself): `train.dtype:
auto` resolves as on a GPU with native bf16 on rank 0 (bfloat16) and as on one without on rank 1 (float32), as on
a cluster whose nodes have different GPUs; the CPU runs both. A one-step train run; prints `RESULT trained: <base
dtype of this rank's model> <train.mixed_precision of its steps>`.

    precision_ranks.py STORE MODEL OUT
"""

from __future__ import annotations

import os
import sys

from models import precision
from pipeline.config import load_config

RANK = int(os.environ["RANK"])


def main() -> None:
    store, model, out = sys.argv[1:4]
    from stages.train import recipe

    precision.bf16_supported = lambda device: RANK == 0  # what `auto` reads of the device
    real_backward, seen = recipe.backward_of, []

    def backward_of(model, fb, tc, device, scale):
        base = {str(p.dtype) for n, p in model.named_parameters() if "lora_" not in n and p.is_floating_point()}
        seen.append(f"{','.join(sorted(base))} {tc.mixed_precision}")
        return real_backward(model, fb, tc, device, scale)

    recipe.backward_of = backward_of
    train = {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.max_steps": 1,
             "train.checkpoint_every": 100}
    recipe.run(load_config(None, train), store, model, out)
    print(f"RESULT trained: {';'.join(sorted(set(seen)))}", flush=True)


if __name__ == "__main__":
    main()
