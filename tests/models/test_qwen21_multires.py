"""Mixed layouts in one Qwen-Image-2.1 batch vs the unmodified diffusers transformer (issue 26 proof).

Reference: the stock `QwenImage21Transformer2DModel.forward` (default processor, untouched) on each sample alone
at batch 1, with its own img_shapes / img_mask and unpadded prompt. The padded batch goes through
`qwen21_forward` on the *same* instance. float32, tiny odd configs, `causal_condition` on and off, 0..10
references of different sizes and aspects, different prompt lengths, different timesteps per sample.
"""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import QwenImage21Transformer2DModel

from models.qwen21_multires import (
    Qwen21Sample,
    build_batch,
    install_qwen21,
    joint_image_mask,
    latent_tokens,
    per_sample_loss,
    qwen21_forward,
    target_outputs,
    tokens_to_latent,
)

C = 8  # latent channels of the tiny configs
TXT = 24
CONFIGS = {
    "2x32_axes8-12-12_causal": dict(num_attention_heads=2, attention_head_dim=32, axes_dims_rope=(8, 12, 12),
                                   causal_condition=True, num_layers=2, mlp_ratio=3),
    "3x16_axes4-6-6_plain": dict(num_attention_heads=3, attention_head_dim=16, axes_dims_rope=(4, 6, 6),
                                 causal_condition=False, num_layers=3, mlp_ratio=2),
}

# Per sample: reference sizes (h, w) in latent tokens (even: whole 2x2 slots), target (h, w), text runs
# (text before each reference, then the tail), adjacent=True puts two references back to back with no text.
MIXED = [
    dict(refs=[(2, 4)], target=(4, 2), text=[3, 5]),
    dict(refs=[], target=(2, 6), text=[7]),  # text to image: no reference
    dict(refs=[(4, 4), (2, 2), (6, 2)], target=(4, 4), text=[2, 1, 4, 3]),
    dict(refs=[(2, 2)] * 5 + [(2, 4)] * 5, target=(2, 2), text=[1, 2, 1, 0, 3, 1, 2, 1, 1, 2, 4]),  # 10 refs
    dict(refs=[(2, 6), (4, 2)], target=(6, 4), text=[4, 0, 2]),  # two references adjacent
]


def make_transformer(name: str, seed: int = 0) -> QwenImage21Transformer2DModel:
    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(patch_size=1, in_channels=C, out_channels=C, context_in_dim=TXT,
                                          **CONFIGS[name])
    # Random init leaves norms at 0 and projections small; give every weight some size so a positional, masking
    # or modulation mistake shows far above float32 noise.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def make_sample(spec, g: torch.Generator) -> Qwen21Sample:
    slot_runs = [h * w // 4 for h, w in spec["refs"]]
    mask = []
    for k, slots in enumerate(slot_runs):
        mask += [False] * spec["text"][k] + [True] * slots
    mask += [False] * spec["text"][-1]
    slot_mask = torch.tensor(mask, dtype=torch.bool)
    refs = [torch.randn(C, 1, h, w, generator=g) for h, w in spec["refs"]]
    th, tw = spec["target"]
    return Qwen21Sample(
        prompt_embeds=torch.randn(len(mask), TXT, generator=g),
        slot_mask=slot_mask,
        references=refs,
        target=torch.randn(th * tw, C, generator=g),
        target_hw=(th, tw),
    )


def stock_alone(model, s: Qwen21Sample, t: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The unmodified forward at batch 1; returns (output [n, C], leaf inputs for gradients)."""
    text = s.prompt_embeds.clone().requires_grad_(True)
    tokens = torch.cat([*(latent_tokens(r) for r in s.references), s.target]).clone().requires_grad_(True)
    slots, _ = joint_image_mask(s.slot_mask, s.target.shape[0])
    img_shapes = [[(1, r.shape[-2], r.shape[-1]) for r in s.references] + [(1, *s.target_hw)]]
    out = model(hidden_states=tokens[None], encoder_hidden_states=text[None], timestep=t.view(1),
                img_shapes=img_shapes, img_mask=slots[None], return_dict=False)[0][0]
    return out, [text, tokens]


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request):
    """(the unmodified reference, an installed copy with identical weights)."""
    stock = make_transformer(request.param)
    ours = copy.deepcopy(stock)
    install_qwen21(ours)
    assert all(type(p).__name__ == "QwenImage21AttnProcessor" for p in stock.attn_processors.values())
    return stock, ours


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4], [3, 1], [4, 0, 2]])
def test_padded_batch_equals_each_sample_alone(models, order):
    stock, ours = models
    g = torch.Generator().manual_seed(len(order))
    samples = [make_sample(MIXED[i], g) for i in order]
    t = torch.rand(len(samples), generator=g)
    batch = build_batch(samples)
    with torch.no_grad():
        out = qwen21_forward(ours, batch, t)
        worst = 0.0
        for b, s in enumerate(samples):
            ref, _ = stock_alone(stock, s, t[b])
            mine = batch.joint(out, b)
            assert mine.shape == ref.shape
            worst = max(worst, ((mine - ref).abs().max() / ref.abs().max()).item())
            pad = out[b][~batch.valid_mask[b]]
            assert torch.equal(pad, torch.zeros_like(pad))  # padding exactly 0
            assert torch.equal(target_outputs(out, batch)[b], mine[-s.target.shape[0]:])  # target last
        # the installed processor is the stock one for a stock call
        s = samples[0]
        assert torch.equal(stock_alone(ours, s, t[0])[0], stock_alone(stock, s, t[0])[0])
    print(f"max relative error {worst:.2e}")
    assert worst <= 1e-5


def test_gradients_equal_and_padding_gets_none(models):
    stock, ours = models
    g = torch.Generator().manual_seed(7)
    samples = [make_sample(MIXED[i], g) for i in (2, 1, 3, 0)]
    t = torch.rand(len(samples), generator=g)
    weights = [torch.randn(build_batch([s]).lengths[0], C, generator=g) for s in samples]

    # reference: each sample alone through the stock forward, gradients summed
    stock.zero_grad()
    ref_inputs = []
    for b, s in enumerate(samples):
        out, leaves = stock_alone(stock, s, t[b])
        (out * weights[b]).sum().backward()
        ref_inputs.append(leaves)
    ref_param_grads = {n: p.grad.clone() for n, p in stock.named_parameters()}

    ours.zero_grad()
    batch = build_batch(samples)
    batch.text.requires_grad_(True)
    batch.image.requires_grad_(True)
    out = qwen21_forward(ours, batch, t)
    w = torch.zeros_like(out)
    for b, wb in enumerate(weights):
        w[b, batch.positions[b]] = wb
    (out * w).sum().backward()

    def rel(a, r):
        return ((a - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()

    worst = max(rel(p.grad, ref_param_grads[n]) for n, p in ours.named_parameters()
                if ref_param_grads[n].abs().max() > 0)
    for b, (text, tokens) in enumerate(ref_inputs):
        img = batch.image_mask[b][batch.positions[b]]
        worst = max(worst, rel(batch.joint(batch.image.grad, b)[img], tokens.grad))
        worst = max(worst, rel(batch.joint(batch.text.grad, b)[~img], text.grad[~samples[b].slot_mask]))
        for grad in (batch.image.grad, batch.text.grad):
            pad = grad[b][~batch.valid_mask[b]]
            assert torch.equal(pad, torch.zeros_like(pad))
    print(f"max relative gradient error {worst:.2e}")
    assert worst <= 1e-5


def test_gradient_checkpointing_same_gradients(models):
    _, model = models
    g = torch.Generator().manual_seed(3)
    samples = [make_sample(MIXED[i], g) for i in (0, 2)]
    batch, t = build_batch(samples), torch.rand(2, generator=g)
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        if ckpt:
            model.enable_gradient_checkpointing()
        else:
            model.disable_gradient_checkpointing()
        per_sample_loss(qwen21_forward(model, batch, t), torch.zeros_like(batch.image), batch).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.disable_gradient_checkpointing()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_loss_is_normalised_per_sample():
    g = torch.Generator().manual_seed(0)
    small, large = make_sample(MIXED[3], g), make_sample(MIXED[4], g)
    batch = build_batch([small, large])
    out = torch.zeros_like(batch.image)
    target = torch.zeros_like(batch.image)
    target[batch.target_mask] = 1.0  # every target token off by 1 -> per-sample loss 1 whatever its size
    target[~batch.target_mask] = 5.0  # references, text, padding: never in the loss
    assert per_sample_loss(out, target, batch).tolist() == [1.0, 1.0]


def test_layout_errors_are_refused():
    g = torch.Generator().manual_seed(0)
    s = make_sample(MIXED[0], g)
    s.references[0] = torch.randn(C, 1, 4, 4)  # 16 tokens, the prompt has 2 slots for 8
    with pytest.raises(ValueError, match="VLM grid must equal the VAE grid"):
        build_batch([s])
    eleven = make_sample(dict(refs=[(2, 2)] * 11, target=(2, 2), text=[1] * 12), g)
    with pytest.raises(ValueError, match="at most 10"):
        build_batch([eleven])


def test_tokens_round_trip():
    lat = torch.randn(C, 1, 4, 6)
    assert torch.equal(tokens_to_latent(latent_tokens(lat), 4, 6), lat)


def _plain_mask(ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The block-causal mask as one expression (what `block_causal_mask` computed before it was written in place)."""
    S = ids.shape[1]
    pos = torch.arange(S)
    same_block = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
    allowed = ((pos[:, None] >= pos[None, :])[None] | same_block) & valid[:, None, :] & valid[:, :, None]
    allowed |= torch.eye(S, dtype=torch.bool)[None] & ~valid[:, :, None]
    return allowed[:, None]


def test_block_causal_mask_is_the_plain_expression():
    from types import SimpleNamespace

    from models.qwen21_multires import block_causal_mask

    g = torch.Generator().manual_seed(0)
    batch = build_batch([make_sample(spec, g) for spec in MIXED])  # padding, adjacent references, 10 references
    assert torch.equal(block_causal_mask(batch), _plain_mask(batch.image_ids, batch.valid_mask))
    # a block whose positions are not one run (not what build_batch writes, still the same mask)
    ids = torch.tensor([[-1, 0, -1, 0, 1, 1, -1, -1]])
    valid = torch.tensor([[True] * 6 + [False] * 2])
    got = block_causal_mask(SimpleNamespace(image_ids=ids, valid_mask=valid))
    assert torch.equal(got, _plain_mask(ids, valid))


def test_block_causal_mask_peaks_at_its_own_size():
    """The mask is [B, S, S] (S ~ 45k tokens at 10 references of 1024²: 2 GiB per sample); building it holds
    about that, not ~5x (measured 5.0x before at S = 8192). Peak RSS of a fresh process, not time."""
    import subprocess
    import sys

    code = """
import resource, torch
from types import SimpleNamespace
from models.qwen21_multires import block_causal_mask
S = 8192
ids = torch.full((1, S), -1, dtype=torch.long); ids[0, 200:3000] = 0; ids[0, 3000:S - 100] = 1
valid = torch.ones(1, S, dtype=torch.bool); valid[0, S - 100:] = False
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
m = block_causal_mask(SimpleNamespace(image_ids=ids, valid_mask=valid))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / m.numel())
"""
    ratio = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert ratio < 2.0, ratio


def test_the_attention_backend_recorded_for_qwen21_is_the_one_it_runs():
    """2.1's processor runs its dense block-causal mask through native SDPA whatever backend is set: the record
    says native, and a configured kernel it would ignore is refused in one line (it was recorded as running)."""
    from models.attention import attention_record, use_attention_backend
    from schemas.errors import UserError

    model = make_transformer("3x16_axes4-6-6_plain")
    install_qwen21(model)
    assert use_attention_backend(model, None, "train.attention_backend", torch.device("cpu"), torch.float32) == "native"
    assert attention_record(model)["backend"] == "native"
    assert "Qwen-Image-2.1" in attention_record(model)["reason"]
    for name in ("packed", "flex", "_native_math"):
        with pytest.raises(UserError, match=rf"train.attention_backend '{name}': Qwen-Image-2.1"):
            use_attention_backend(model, name, "train.attention_backend", torch.device("cpu"), torch.float32)
