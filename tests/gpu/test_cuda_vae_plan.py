"""`pipeline plan`'s VAE terms against CUDA's own allocator: the published Edit-2509 VAE (random weights from its
shipped config, no download) decodes a 1024² image and encodes a batch of 2 in bf16; the allocator's peak above
the weights and the input is the traced plan term (`models.memory_plan.vae_pass_bytes`), within 10 % (the CPU
test checks the same trace against the live tensors to the byte: tests/models/test_memory_plan_decode.py).
Skipped without CUDA (conftest.py)."""

from __future__ import annotations

import json

import pytest
import torch

from models import memory_plan as mp

MODEL = "Qwen/Qwen-Image-Edit-2509"


@pytest.mark.parametrize("encode", [False, True])
def test_planned_vae_pass_is_the_cuda_peak(encode, cuda):
    from diffusers import AutoencoderKLQwenImage

    cfg = json.loads((mp.config_root(MODEL) / "vae" / "config.json").read_text())
    vae = AutoencoderKLQwenImage.from_config(cfg).to(cuda, torch.bfloat16).eval()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        if encode:
            vae.encode(torch.zeros(2, 3, 1, 1024, 1024, device=cuda, dtype=torch.bfloat16))
        else:
            vae.decode(torch.zeros(1, 16, 1, 128, 128, device=cuda, dtype=torch.bfloat16), return_dict=False)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    planned = mp.vae_pass_bytes(MODEL, "bfloat16", 1024, 1024, encode=encode, batch=2 if encode else 1)
    assert abs(planned - measured) <= 0.10 * measured, (mp.gib(planned), mp.gib(measured))
