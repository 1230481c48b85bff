"""Attention backends for padded mixed batches (models/attention.py) vs native SDPA with the padding mask, on
the mixed batch of test_multires (5 samples, different sizes, 0..3 controls, text lengths), float32.

What runs on this CPU: `native`, `_native_math`, `packed` (forward and backward), `flex` (forward only: PyTorch
has no flex backward on the CPU). The varlen kernels (flash-attn, sage) need CUDA packages; what they rely on -
valid keys first, the mask read as a per-sample count - is checked with an emulation of diffusers'
`_flash_varlen_attention` (each sample's queries against its first `count` keys)."""

from __future__ import annotations

import copy

import pytest
import torch

from models.attention import BACKENDS, attend, check_name, keys_first, packed_attention, resolve, set_backend
from models.multires import install_multires, multires_forward
from schemas import UserError
from test_multires import MIXED, SIGMAS, batch_of, make_samples, make_transformer, rel_err


@pytest.fixture(scope="module")
def native_and_batch():
    model = make_transformer("axes4-14-14_4x32_zero-cond-t")
    install_multires(model)
    batch = batch_of(make_samples(MIXED))
    model.zero_grad()
    out = multires_forward(model, batch, SIGMAS)
    (out.square().mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return model, batch, out.detach(), grads


@pytest.mark.parametrize("backend", ["_native_math", "packed"])
def test_backend_equals_native_forward_and_gradients(native_and_batch, backend):
    base, batch, ref, ref_grads = native_and_batch
    model = copy.deepcopy(base)
    model.zero_grad()
    set_backend(model, backend)
    out = multires_forward(model, batch, SIGMAS)
    assert rel_err(out.detach(), ref) <= 1e-5
    assert torch.equal(out[~batch.image_mask], torch.zeros_like(out[~batch.image_mask]))
    out.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    assert max(rel_err(grads[n], ref_grads[n]) for n in grads if ref_grads[n].abs().max() > 0) <= 1e-5


def test_flex_forward_equals_native(native_and_batch):
    base, batch, ref, _ = native_and_batch
    model = copy.deepcopy(base)
    set_backend(model, "flex")
    with torch.no_grad(), pytest.warns(UserWarning, match="without torch.compile"):
        out = multires_forward(model, batch, SIGMAS)
    assert rel_err(out, ref) <= 1e-5


def test_xformers_masks_the_padding(native_and_batch, monkeypatch):
    """diffusers' xformers backend, run over a stand-in for `xformers.ops.memory_efficient_attention` with
    xformers' documented semantics (BMHK tensors, `attn_bias` added to the scaled scores): the padded batch
    gives native SDPA's result. The 4-D bool mask went in as an additive 1/0 bias: padding attended (rel err
    0.078 on this batch)."""
    import types

    from diffusers.models import attention_dispatch

    def memory_efficient_attention(q, k, v, attn_bias=None, p=0.0, scale=None):
        assert attn_bias is None or attn_bias.is_floating_point()
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_bias, dropout_p=p, scale=scale)
        return out.transpose(1, 2)

    monkeypatch.setattr(attention_dispatch, "xops", types.SimpleNamespace(
        memory_efficient_attention=memory_efficient_attention, LowerTriangularMask=None), raising=False)
    base, batch, ref, _ = native_and_batch
    model = copy.deepcopy(base)
    set_backend(model, "xformers")
    with torch.no_grad():
        out = multires_forward(model, batch, SIGMAS)
    assert rel_err(out, ref) <= 1e-5


def _mask_with_holes(b=3, s=40):
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[0, 5:12] = False  # text padding in the middle of the joint sequence
    mask[1, 30:] = False
    mask[2, 2:4] = False
    mask[2, 35:] = False
    return mask


def test_keys_first_gives_what_varlen_kernels_read():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 40, 2, 16, generator=g) for _ in range(3))
    mask = _mask_with_holes()
    ref = attend(q, k, v, mask[:, None, None, :], "native")
    k2, v2, prefix = keys_first(k, v, mask)
    counts = mask.sum(1)
    assert torch.equal(prefix, torch.arange(40)[None] < counts[:, None])
    # diffusers' _flash_varlen_attention: every query of sample b against keys[b, :count_b].
    emulated = torch.stack([
        torch.nn.functional.scaled_dot_product_attention(
            q[b].transpose(0, 1), k2[b, :n].transpose(0, 1), v2[b, :n].transpose(0, 1)).transpose(0, 1)
        for b, n in enumerate(counts.tolist())
    ])
    assert rel_err(emulated, ref) <= 1e-5


def test_packed_attention_layout_and_errors():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 40, 2, 16, generator=g) for _ in range(3))
    mask = _mask_with_holes()
    ref = attend(q, k, v, mask[:, None, None, :], "native")
    out = packed_attention(q, k, v, mask[:, None, None, :])
    assert rel_err(out[mask], ref[mask]) <= 1e-5
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))  # padded queries: skipped
    assert rel_err(packed_attention(q, k, v, None), attend(q, k, v, None, "native")) <= 1e-5
    with pytest.raises(UserError, match="honours the padding mask"):
        check_name("_native_flash", "train.attention_backend")
    check_name("flash_varlen", "train.attention_backend")
    assert resolve(None, torch.device("cpu"), torch.float32) == "native"
    assert resolve("packed", torch.device("cpu"), torch.float32) == "packed"
    assert "native" in BACKENDS and "flash" not in BACKENDS


def test_default_choice_is_reported_with_the_probe_error_never_silent(capsys):
    """A failed `packed` probe on CUDA (here: no CUDA at all, or a kernel that raises) falls back to native
    with the exception text in the reason, printed once, and kept on the model for the run record."""
    from models import attention

    model = make_transformer("axes8-12-12_2x32")
    install_multires(model)
    attention._probes.clear()
    attention._announced.clear()
    real = attention.packed_attention

    def broken(*a, **k):
        raise RuntimeError("no varlen kernel for this build")

    attention.packed_attention = broken  # on a GPU machine the probe gets this far; on a CPU one, not even
    try:
        chosen = attention.use_attention_backend(model, None, "train.attention_backend", torch.device("cuda"), torch.bfloat16)
        attention.use_attention_backend(model, None, "train.attention_backend", torch.device("cuda"), torch.bfloat16)
    finally:
        attention.packed_attention = real
        attention._probes.clear()
    assert chosen == "native"
    record = attention.attention_record(model)
    assert record["backend"] == "native" and record["probe"]["ok"] is False
    error = record["probe"]["error"]
    assert error and ":" in error  # "ExceptionType: text"
    assert record["reason"].startswith("packed probe failed") and error in record["reason"]
    err = capsys.readouterr().err
    assert err.count("train.attention_backend: native (packed probe failed") == 1 and error in err



def test_under_a_launcher_only_rank_0_announces_unless_its_probe_failed(capsys, monkeypatch):
    """`pipeline launch --nproc-per-node 8 run all`: every rank printed `train.attention_backend: native (...)`,
    8 copies of one decision. Rank 0 says it; another rank only when its own probe failed (an odd GPU), named."""
    from models import attention

    monkeypatch.setattr(attention, "_announced", set())
    default = attention.Choice("native", "default on cpu: native SDPA with the padding mask")
    failed = attention.Choice("native", "packed probe failed, falling back to native SDPA: boom", {"ok": False})
    monkeypatch.setenv("RANK", "1")
    attention.announce(default, "train.attention_backend")
    attention.announce(failed, "train.attention_backend")
    monkeypatch.setenv("RANK", "0")
    attention.announce(default, "evaluate.attention_backend")
    err = capsys.readouterr().err.splitlines()
    assert err == ["rank 1: train.attention_backend: native (packed probe failed, falling back to native SDPA: boom)",
                   "evaluate.attention_backend: native (default on cpu: native SDPA with the padding mask)"], err
