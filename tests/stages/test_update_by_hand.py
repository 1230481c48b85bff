"""The trainer's LoRA after a few optimizer steps against a hand-written update (one process, float64): each
step's loss the mean over its samples of each sample's loss run alone (batch 1, no padding, the step's own σ,
noise and caption-dropout draws), its gradient clipped to max_grad_norm by hand, then AdamW written out
(decoupled weight decay, bias-corrected moments) at the LR of the warm-up read one step ahead and the cosine after
it. Mixed-size padded batches (fixed batches and a token budget), accumulation over 2 micro-batches, steps across
an epoch's end, masked token weights. Checks what resume and layout tests cannot (they compare the trainer with
itself): that the update it applies is the documented one."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from models.flow import flow_loss_of
from models.lora import lora_parameters, lora_state_dict, read_lora
from pipeline.config import load_config
from stages.train import recipe
from stages.train.budget import make_sampler
from stages.train.build import setup_transformer
from stages.train.data import open_inputs
from stages.train.prefetch import prepare
from stages.train.schedule import lr_factor
from train_store import make_train_store, mixed_specs

STEPS, ACCUM, BATCH = 3, 2, 2
SETS = {"train.device": "cpu", "train.lora.rank": 4, "train.max_steps": STEPS, "train.batch_size": BATCH,
        "train.grad_accum": ACCUM, "train.sigma.sampling": "uniform", "train.learning_rate": 1e-2,
        "train.warmup_steps": 2, "train.lr_schedule": "cosine", "train.max_grad_norm": 0.05,
        "train.weight_decay": 0.1, "train.caption_dropout": 0.5, "train.loss.mask_weight.foreground": 3.0}


@pytest.fixture(scope="module")
def store(tiny_edit_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("by-hand") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(8, masks=True))
    return root


def _float64(monkeypatch) -> None:
    real = recipe.setup_transformer
    monkeypatch.setattr(recipe, "setup_transformer", lambda *a, **k: real(*a, **k).to(torch.float64))


def _step_loss(transformer, tables, cfg, samples: list[int], step: int) -> torch.Tensor:
    """The mean of each sample's loss alone, with the draws the trainer makes for it at `step` (a repeat in the
    step draws its own)."""
    seen: Counter = Counter()
    losses = []
    for i in samples:
        key = tables.keys[i]
        fb = prepare(tables, cfg, [i], step, torch.device("cpu"), torch.float64,
                     repeats={key: seen[key]} if seen[key] else None)
        losses.append(flow_loss_of(transformer, fb))
        seen[key] += 1
    return torch.cat(losses).mean()


@torch.no_grad()
def _adamw(params, moments, step: int, cfg) -> None:
    """One clipped AdamW update, written out (torch's default eps placement and clip coefficient)."""
    grads = [p.grad for p in params]
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    clip = min(1.0, cfg.max_grad_norm / (norm + 1e-6))
    lr = cfg.learning_rate * lr_factor(step, cfg)
    (b1, b2), eps = cfg.adam_betas, cfg.adam_eps
    for p, g, (m, v) in zip(params, grads, moments):
        g = g * clip
        p.mul_(1 - lr * cfg.weight_decay)
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        m_hat, v_hat = m / (1 - b1 ** (step + 1)), v / (1 - b2 ** (step + 1))
        p.sub_(lr * m_hat / (v_hat.sqrt() + eps))


def _by_hand(model: str, store, cfg) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """(the LoRA, the step losses, the gradient norms) of STEPS hand-written steps."""
    tables = open_inputs(store, model)
    try:
        sampler = make_sampler(tables.lengths, BATCH, cfg.max_tokens_per_batch, cfg.seed, cfg.sampler_window, 1)
        micro = [b for epoch in range(STEPS) for b in sampler.global_steps(epoch)]
        transformer = setup_transformer(model, cfg, torch.device("cpu")).to(torch.float64)
        params = lora_parameters(transformer)
        moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
        losses, norms = [], []
        for k in range(STEPS):
            samples = [i for m in micro[k * ACCUM:(k + 1) * ACCUM] for batch in m for i in batch]
            for p in params:
                p.grad = None
            loss = _step_loss(transformer, tables, cfg, samples, k)
            loss.backward()
            losses.append(loss.item())
            norms.append(math.sqrt(sum(float((p.grad * p.grad).sum()) for p in params)))
            _adamw(params, moments, k, cfg)
        return lora_state_dict(transformer), losses, norms
    finally:
        tables.close()


@pytest.mark.parametrize("budget", [None, 80], ids=["fixed-batches", "token-budget"])
def test_the_trainers_update_is_adamw_of_the_mean_per_sample_loss_by_hand(budget, store, tiny_edit_model, tmp_path,
                                                                         monkeypatch):
    sets = {**SETS, "train.max_tokens_per_batch": budget}
    cfg = load_config(None, sets).train
    _float64(monkeypatch)
    result = recipe.run(load_config(None, sets), store, tiny_edit_model, tmp_path / "run")
    got = read_lora(tmp_path / "run" / "lora")[0]
    want, losses, norms = _by_hand(tiny_edit_model, store, cfg)

    assert norms[0] > cfg.max_grad_norm  # clipping acts at least once
    # the flow loss is float32 (models.flow.per_sample_loss), summed in another order here
    assert list(result.losses) == pytest.approx(losses, rel=1e-6)
    assert got.keys() == want.keys()
    moved = max(float((want[k] - v).abs().max()) for k, v in
                lora_state_dict(setup_transformer(tiny_edit_model, cfg, torch.device("cpu"))).items())
    worst = max(float((got[k].double() - want[k]).abs().max()) for k in want)
    assert moved > 1e-3 and worst <= 1e-8, (worst, moved)  # Adam's step is ~lr x sign: 1e-7 in a gradient is ~1e-9
