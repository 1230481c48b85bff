"""Flow-matching math: sigma sampling (against the real scheduler's shift functions), noising, per-sample loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_shift as diffusers_calculate_shift

from models.flow import (
    add_noise,
    batch_loss,
    flow_target,
    mask_token_weights,
    per_sample_loss,
    sample_sigmas,
)
from models.multires import build_batch, target_outputs
from models.tiny import SCHEDULER_CONFIG
from schemas.config import SigmaConfig

MODES = ["uniform", "logit_normal", "shift", "dynamic_shift"]


def sigmas(mode: str, seed: int, n: int = 20_000, seq_len: int = 1024, **cfg) -> torch.Tensor:
    return sample_sigmas(n, SigmaConfig(sampling=mode, **cfg), torch.Generator().manual_seed(seed), [seq_len] * n)


@pytest.mark.parametrize("mode", MODES)
def test_sigmas_in_range_and_deterministic_per_generator(mode):
    a, b, c = sigmas(mode, 0), sigmas(mode, 0), sigmas(mode, 1)
    assert a.shape == (20_000,) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.min() >= 0 and a.max() <= 1
    assert 0.1 < a.std() < 0.4  # spread over the range, not collapsed


def test_sigma_distributions_match_their_definitions():
    q = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9])
    u = sigmas("uniform", 0)
    assert torch.allclose(torch.quantile(u, q), q, atol=0.015)
    ln = sigmas("logit_normal", 0, logit_mean=0.5, logit_std=1.2)
    normal_q = torch.distributions.Normal(0.5, 1.2).icdf(q)
    assert torch.allclose(torch.quantile(ln, q), torch.sigmoid(normal_q), atol=0.015)
    s = 3.0
    sh = sigmas("shift", 0, shift=s)
    assert torch.allclose(torch.quantile(sh, q), s * q / (1 + (s - 1) * q), atol=0.015)
    assert sh.mean() > u.mean() + 0.1  # shift > 1 pushes towards noise


def test_dynamic_shift_equals_real_scheduler_and_is_monotone_in_seq_len():
    cfg = SigmaConfig(sampling="dynamic_shift")
    assert (cfg.base_shift, cfg.max_shift, cfg.base_image_seq_len, cfg.max_image_seq_len) == (
        SCHEDULER_CONFIG["base_shift"],
        SCHEDULER_CONFIG["max_shift"],
        SCHEDULER_CONFIG["base_image_seq_len"],
        SCHEDULER_CONFIG["max_image_seq_len"],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    seq_lens = [64, 256, 1024, 4096, 8192, 16384]
    n = 2000
    u = torch.rand(n, generator=torch.Generator().manual_seed(5))
    per_len = []
    for seq in seq_lens:
        got = sample_sigmas(n, cfg, torch.Generator().manual_seed(5), [seq] * n)
        mu = diffusers_calculate_shift(
            seq, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift
        )
        ref = torch.tensor([scheduler.time_shift(mu, 1.0, x) for x in u.tolist()[:200]], dtype=torch.float32)
        assert torch.allclose(got[:200], ref, atol=1e-6)
        per_len.append(got)
    for shorter, longer in zip(per_len, per_len[1:]):
        assert torch.all(longer >= shorter) and longer.mean() > shorter.mean()
    # Per-sample seq lens inside one call: each sample gets its own shift.
    mixed = sample_sigmas(2, cfg, torch.Generator().manual_seed(5), [seq_lens[1], seq_lens[4]])
    assert mixed[0] == per_len[1][0] and mixed[1] == per_len[4][1]


def test_add_noise_and_target_are_rectified_flow():
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(3, 5, 16, generator=g), torch.randn(3, 5, 16, generator=g)
    sigma = torch.tensor([0.0, 0.4, 1.0])
    xt = add_noise(x0, eps, sigma)
    assert torch.equal(xt[0], x0[0]) and torch.equal(xt[2], eps[2])
    v = flow_target(x0, eps)
    # Moving along the velocity recovers both ends (what the Euler sampler relies on).
    assert torch.allclose(xt[1] - 0.4 * v[1], x0[1], atol=1e-6)
    assert torch.allclose(xt[1] + 0.6 * v[1], eps[1], atol=1e-6)
    # Scalar sigma for a single unbatched sample.
    assert torch.allclose(add_noise(x0[1], eps[1], torch.tensor(0.4)), xt[1])
    # Same as the real scheduler's forward process.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    t = scheduler.timesteps[600:601]
    s = scheduler.sigmas[600]
    assert torch.allclose(scheduler.scale_noise(x0[:1], t, eps[:1]), add_noise(x0[:1], eps[:1], s.reshape(1)), atol=1e-6)


def padded_predictions(seed: int = 0):
    """A padded multi-resolution batch of (pred, target, mask) built through the real packing code."""
    g = torch.Generator().manual_seed(seed)
    sizes = [(2, 3), (4, 4), (1, 5), (3, 2)]  # target patch grids, different token counts
    targets = [torch.randn(h * w, 16, generator=g) for h, w in sizes]
    controls = [[torch.randn(4, 1, 4, 4, generator=g)] * k for k in (0, 1, 2, 3)]
    prompts = [torch.randn(n, 8, generator=g) for n in (3, 6, 2, 5)]
    shapes = [[(1, h, w)] + [(1, 2, 2)] * k for (h, w), k in zip(sizes, (0, 1, 2, 3))]
    batch = build_batch(targets, controls, prompts, shapes)
    out = torch.randn(batch.hidden_states.shape, generator=g)
    out = torch.where(batch.image_mask[..., None], out, 0.0)
    masks = [(torch.rand(h * w, generator=g) > 0.5).float() for h, w in sizes]
    return target_outputs(out, batch), targets, masks


def test_padded_batch_loss_equals_mean_of_per_sample_losses():
    preds, targets, masks = padded_predictions()
    alone = torch.stack([F.mse_loss(p, t) for p, t in zip(preds, targets)])
    assert torch.allclose(per_sample_loss(preds, targets), alone, rtol=1e-6, atol=0)
    assert abs(batch_loss(preds, targets).item() - alone.mean().item()) <= 1e-6 * alone.mean().item()

    weights = [mask_token_weights(m, foreground=3.0, background=0.5) for m in masks]
    masked_alone = []
    for p, t, w in zip(preds, targets, weights):
        se = ((p - t) ** 2).mean(dim=-1)
        masked_alone.append((w * se).sum() / w.sum())
        assert torch.allclose(per_sample_loss([p], [t], [w])[0], masked_alone[-1], rtol=1e-6, atol=0)
    masked_alone = torch.stack(masked_alone)
    got = batch_loss(preds, targets, weights)
    assert abs(got.item() - masked_alone.mean().item()) <= 1e-6 * masked_alone.mean().item()
    assert not torch.allclose(masked_alone, alone)  # the weighting did something


def test_all_foreground_or_all_background_mask_is_the_unmasked_loss():
    preds, targets, masks = padded_predictions(1)
    plain = per_sample_loss(preds, targets)
    for fill in (1.0, 0.0):
        weights = [mask_token_weights(torch.full_like(m, fill), foreground=4.0, background=0.25) for m in masks]
        assert torch.allclose(per_sample_loss(preds, targets, weights), plain, rtol=1e-6, atol=0)
    # Default weights 1/1 are off whatever the mask.
    ones = [mask_token_weights(m, 1.0, 1.0) for m in masks]
    assert torch.allclose(per_sample_loss(preds, targets, ones), plain, rtol=1e-6, atol=0)
    # A sample with zero total weight contributes 0, not NaN.
    zero = per_sample_loss(preds[:1], targets[:1], [torch.zeros_like(masks[0])])
    assert zero.item() == 0.0


@pytest.mark.parametrize("fg,bg", [(1.0, 0.25), (2.0, 1.0), (0.5, 3.0)])
def test_gradients_at_background_tokens_scale_with_b_over_f(fg, bg):
    n, c = 12, 16
    mask = torch.tensor([1.0, 0.0] * (n // 2))
    target = torch.zeros(n, c)
    pred = torch.ones(n, c, requires_grad=True)  # the same error at every token
    batch_loss([pred], [target], [mask_token_weights(mask, fg, bg)]).backward()
    g_fg, g_bg = pred.grad[mask == 1], pred.grad[mask == 0]
    assert torch.allclose(g_fg, g_fg[0].expand_as(g_fg)) and torch.allclose(g_bg, g_bg[0].expand_as(g_bg))
    assert abs((g_bg[0, 0] / g_fg[0, 0]).item() - bg / fg) <= 1e-6 * bg / fg


def test_mask_token_weights_values():
    m = torch.tensor([0.0, 0.25, 1.0])
    assert torch.allclose(mask_token_weights(m, 2.0, 0.5), torch.tensor([0.5, 0.875, 2.0]))
    assert mask_token_weights(m, 2.0, 0.5).dtype == torch.float32
