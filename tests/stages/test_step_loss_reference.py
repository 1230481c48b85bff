"""The loss a step optimises and logs, against a reference computed sample by sample: two gloo processes, token-
budget batches (1-4 samples of different lengths, so padded), 2 accumulation micro-batches, the tiny model and its
LoRA in float64. docs/train.md promises the mean over the step's samples of each sample's loss (itself the mean
over its own target tokens): the reference runs each sample of the step alone (batch 1, no padding, one process)
with the same σ and noise draws, averages, and takes the gradient of that mean. The logged loss and the LoRA
gradient the optimizer was given (after DDP's all-reduce) must equal it within 1e-6."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from models.flow import flow_loss_of
from models.lora import lora_parameters
from pipeline.config import load_config
from stages.train.budget import make_sampler
from stages.train.build import setup_transformer
from stages.train.prefetch import prepare
from train_store import make_train_store, mixed_specs, open_split
from two_ranks import launch_two

BUDGET, ACCUM = 80, 2


def test_the_logged_and_optimised_loss_is_the_mean_per_sample_loss(tiny_edit_model, tmp_path) -> None:
    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(8))  # joint lengths 9..56 tokens
    (rc0, _, err0), (rc1, _, err1) = launch_two("rank_float64_step.py", str(store), tiny_edit_model,
                                                str(tmp_path / "out"), str(BUDGET), str(ACCUM))
    assert rc0 == rc1 == 0, (err0[-3000:], err1[-3000:])
    got = load_file(tmp_path / "out" / "step1.safetensors")

    cfg = load_config(None, {"train.device": "cpu", "train.lora.rank": 4, "train.max_tokens_per_batch": BUDGET,
                             "train.grad_accum": ACCUM, "train.sigma.sampling": "uniform"}).train
    tables = open_split(store, tiny_edit_model)
    try:
        plan = make_sampler(tables.lengths, cfg.batch_size, BUDGET, cfg.seed, cfg.sampler_window, 2).global_steps(0)
        micro = [plan[k] for k in range(ACCUM)]  # step 1: the first ACCUM global micro-batches, both ranks' batches
        samples = [i for m in micro for batch in m for i in batch]
        assert any(len(batch) > 1 and len({int(tables.lengths[i]) for i in batch}) > 1 for m in micro for batch in m)
        transformer = setup_transformer(tiny_edit_model, cfg, torch.device("cpu")).to(torch.float64)
        losses = torch.cat([flow_loss_of(transformer, prepare(tables, cfg, [i], 0, torch.device("cpu"), torch.float64))
                            for i in samples])  # each sample alone
    finally:
        tables.close()
    mean = losses.mean()
    mean.backward()
    want = [p.grad for p in lora_parameters(transformer)]

    assert len(samples) == len(set(samples)) > ACCUM * 2
    assert abs(got["loss"].item() - mean.item()) <= 1e-6 * abs(mean.item()), (got["loss"].item(), mean.item())
    grads = [got[f"grad.{i}"] for i in range(len(want))]
    scale = max(g.abs().max().item() for g in want)
    worst = max((g - w).abs().max().item() for g, w in zip(grads, want))
    assert worst <= 1e-6 * scale, (worst, scale)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(w) for w in want])).item()
    assert abs(got["grad_norm"].item() - norm) <= 1e-6 * norm, (got["grad_norm"].item(), norm)
