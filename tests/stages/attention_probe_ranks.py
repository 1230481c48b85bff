"""Run by each of two gloo processes (tests/stages/test_attention_probe_ranks.py, not a test module itself): each
rank resolves the default attention backend as on a CUDA bf16 device (the one place the default probes a
kernel), and the packed probe passes on rank 0 but fails on rank 1, as on a node with another GPU or driver. A
one-step train run; prints `RESULT backend: <what this rank's processors run>` and `RESULT record: <the choice
kept on this rank's model, JSON>`.

    attention_probe_ranks.py STORE MODEL OUT
"""

from __future__ import annotations

import json
import os
import sys

import torch

from models import attention
from pipeline.config import load_config

RANK = int(os.environ["RANK"])


def main() -> None:
    store, model, out = sys.argv[1:4]
    from models.multires import MaskedJointAttnProcessor
    from stages.train import recipe

    real_choose, real_setup = attention.choose, recipe.setup_transformer
    # the default as on CUDA in bf16 (the model itself stays on the CPU, where packed and native both run)
    attention.choose = lambda name, device, dtype, key="attention_backend": real_choose(
        name, torch.device("cuda"), torch.bfloat16, key)
    attention.probe_packed = lambda device, dtype: (
        {"ok": True, "max_rel_err": 1e-3, "error": None, "head_dim": 128} if RANK == 0 else
        {"ok": False, "max_rel_err": None, "error": "RuntimeError: no varlen kernel here (rank 1, injected)",
         "head_dim": 128})
    models = []
    recipe.setup_transformer = lambda *a, **k: models.append(real_setup(*a, **k)) or models[-1]

    train = {"train.device": "cpu", "train.batch_size": 2, "train.lora.rank": 4, "train.max_steps": 1,
             "train.checkpoint_every": 100}
    recipe.run(load_config(None, train), store, model, out)
    kernels = {proc._multires_backend or "native" for proc in models[0].attn_processors.values()
               if isinstance(proc, MaskedJointAttnProcessor)}
    print(f"RESULT backend: {','.join(sorted(kernels))}", flush=True)
    print(f"RESULT record: {json.dumps(attention.attention_record(models[0]))}", flush=True)


if __name__ == "__main__":
    main()
