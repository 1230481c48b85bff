"""CUDA attention checks added after the CPU review of models/ (bench/gpu/README.md lists them): packed attention
at the real model's head dim (128; the probe ran at 64 before), diffusers' real xformers kernel on a padded
batch. Skipped without CUDA (conftest.py); xformers when it is not installed."""

from __future__ import annotations

import copy

import pytest
import torch

from bench.gpu.correctness import batched, compare, make_model, make_samples, stock_reference

REAL_HEAD = dict(heads=2, head_dim=128, axes=(16, 56, 56), joint=64, layers=1, channels=4)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_packed_attention_equals_masked_native_at_the_models_head_dim(cuda, head_dim):
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from models.attention import packed_attention

    g = torch.Generator(cuda).manual_seed(0)
    q, k, v = (torch.randn(3, 700, 24, head_dim, device=cuda, dtype=torch.bfloat16, generator=g) for _ in range(3))
    mask = torch.ones(3, 700, dtype=torch.bool, device=cuda)
    mask[0, 40:90] = False  # padded text inside the joint sequence
    mask[1, 500:] = False
    ours = packed_attention(q, k, v, mask)
    ref = dispatch_attention_fn(q.float(), k.float(), v.float(), attn_mask=mask[:, None, None, :], backend="native")
    err = ((ours.float() - ref)[mask].abs().max() / ref[mask].abs().max()).item()
    assert err <= 2e-2, err
    assert torch.count_nonzero(ours[~mask]) == 0


def test_the_probe_runs_at_the_real_head_dim(cuda):
    from models.attention import probe_packed

    result = probe_packed(cuda, torch.bfloat16)
    assert result["ok"] and result["head_dim"] == 128, result


def _samples_and_reference(cuda):
    samples = make_samples(REAL_HEAD, smoke=True)
    sigmas = torch.tensor([0.5, 0.25, 0.75])
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(s["target"].shape[0] + sum(c.shape[-1] * c.shape[-2] // 4 for c in s["controls"]),
                           4 * REAL_HEAD["channels"], generator=g) for s in samples]
    stock = make_model(REAL_HEAD, torch.float32, cuda)
    return samples, sigmas, weights, stock, stock_reference(stock, samples, sigmas, weights, cuda)


def test_real_xformers_masks_the_padding_on_a_padded_batch(cuda):
    """attention_backend xformers: the [B, S] mask diffusers turns into xformers' bias (a 4-D bool mask became an
    additive 1/0 bias: padding attended). Against each sample alone through the stock model (fp32), in bf16
    within twice masked native SDPA's own bf16 error."""
    pytest.importorskip("xformers", reason="xformers is not installed on this machine")
    samples, sigmas, weights, stock, ref = _samples_and_reference(cuda)
    floor = compare(batched(_installed(stock), samples, sigmas, weights, cuda, "native"), ref)  # bf16's own error
    errs = compare(batched(_installed(stock), samples, sigmas, weights, cuda, "xformers"), ref)
    assert errs["padded_out_exact_zero"], errs
    for key in ("forward", "grad_input_image", "grad_input_text"):
        assert errs[key] <= max(2e-2, 2 * floor[key]), (key, errs, floor)


def _installed(stock):
    from models.multires import install_multires

    multi = copy.deepcopy(stock).to(torch.bfloat16)
    install_multires(multi)
    return multi
