"""Mixed-resolution transformer path vs the unmodified diffusers transformer (DESIGN §5 proof obligations).

Reference: a separate, stock `QwenImageTransformer2DModel` instance with identical weights, run on each sample
alone at batch 1 with its own img_shapes and unpadded text. float32, tiny models, two configs (different
axes_dims_rope and head counts; the second with zero_cond_t=True as in Edit-2511-style models).
"""

from __future__ import annotations

import copy
from math import prod

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0, QwenEmbedRope
from peft import LoraConfig

from models.multires import (
    MaskedJointAttnProcessor,
    PerSampleRope,
    build_batch,
    install_multires,
    is_installed,
    multires_forward,
    pack_latents,
    target_outputs,
    unpack_latents,
)

C = 4  # latent channels -> 16 packed channels
TXT_DIM = 32
CONFIGS = {
    "axes8-12-12_2x32": dict(num_attention_heads=2, axes_dims_rope=(8, 12, 12), zero_cond_t=False),
    "axes4-14-14_4x32_zero-cond-t": dict(num_attention_heads=4, axes_dims_rope=(4, 14, 14), zero_cond_t=True),
}

# (target (h, w) in patches, control sizes, text length): different target sizes (odd sides too), 0..3 controls
# of different sizes, different text lengths.
MIXED = [
    ((4, 6), [(6, 4)], 5),
    ((6, 4), [], 9),
    ((2, 4), [(4, 6), (2, 2), (6, 6)], 3),
    ((8, 8), [(2, 4), (4, 4)], 12),
    ((5, 3), [(3, 3)], 7),
]


def make_transformer(name: str, seed: int = 0) -> QwenImageTransformer2DModel:
    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * C,
        out_channels=C,
        num_layers=2,
        attention_head_dim=32,
        joint_attention_dim=TXT_DIM,
        **CONFIGS[name],
    )
    # Random init leaves the output projection and modulations small; give every weight some size so
    # positional / masking mistakes show up far above float32 noise.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request):
    """(stock reference, installed copy with identical weights)."""
    stock = make_transformer(request.param)
    multi = copy.deepcopy(stock)
    install_multires(multi)
    return stock, multi


def make_samples(spec, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for (h, w), controls, text_len in spec:
        samples.append(
            dict(
                target=pack_latents(torch.randn(C, 1, 2 * h, 2 * w, generator=g)),
                controls=[torch.randn(C, 1, 2 * a, 2 * b, generator=g) for a, b in controls],
                prompt=torch.randn(text_len, TXT_DIM, generator=g),
                shapes=[(1, h, w)] + [(1, a, b) for a, b in controls],
            )
        )
    return samples


def batch_of(samples):
    return build_batch(
        [s["target"] for s in samples],
        [s["controls"] for s in samples],
        [s["prompt"] for s in samples],
        [s["shapes"] for s in samples],
    )


def stock_alone(stock, sample, sigma: torch.Tensor, hidden: torch.Tensor | None = None, prompt=None):
    """The unmodified transformer on one sample at batch 1, its own img_shapes, unpadded text, no mask."""
    if hidden is None:
        hidden = torch.cat([sample["target"]] + [pack_latents(c) for c in sample["controls"]])
    prompt = sample["prompt"] if prompt is None else prompt
    return stock(
        hidden_states=hidden[None],
        encoder_hidden_states=prompt[None],
        timestep=sigma.reshape(1),
        img_shapes=[sample["shapes"]],
        return_dict=False,
    )[0][0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


SIGMAS = torch.tensor([0.9, 0.3, 0.55, 0.7, 0.15])


def test_pack_unpack_match_diffusers():
    from diffusers import QwenImageEditPipeline

    lat = torch.randn(C, 1, 6, 10)
    ref = QwenImageEditPipeline._pack_latents(lat[None], 1, C, 6, 10)[0]
    assert torch.equal(pack_latents(lat), ref)
    assert torch.equal(pack_latents(lat[:, 0]), ref)
    # diffusers' _unpack_latents takes pixel sizes (latent * vae_scale_factor).
    back = QwenImageEditPipeline._unpack_latents(ref[None], 6 * 8, 10 * 8, 8)[0]
    assert torch.equal(unpack_latents(ref, 6, 10), back)
    assert torch.equal(unpack_latents(ref, 6, 10), lat)


def test_install_keeps_parameters_and_is_idempotent(models):
    stock, multi = models
    ref_state, state = stock.state_dict(), multi.state_dict()
    assert list(ref_state) == list(state)
    assert all(torch.equal(ref_state[k], state[k]) for k in ref_state)
    assert isinstance(stock.pos_embed, QwenEmbedRope)
    assert all(type(p) is QwenDoubleStreamAttnProcessor2_0 for p in stock.attn_processors.values())
    install_multires(multi)  # second call changes nothing
    assert isinstance(multi.pos_embed, PerSampleRope) and isinstance(multi.pos_embed.stock, QwenEmbedRope)
    assert all(isinstance(p, MaskedJointAttnProcessor) for p in multi.attn_processors.values())
    assert list(multi.state_dict()) == list(ref_state)


@torch.no_grad()
def test_same_size_batch_is_bit_identical_to_stock(models):
    stock, multi = models
    spec = [((4, 6), [(2, 4)], 5), ((4, 6), [(2, 4)], 9), ((4, 6), [(2, 4)], 7)]
    batch = batch_of(make_samples(spec))
    sigma = SIGMAS[:3]
    out = multires_forward(multi, batch, sigma)

    def called_the_stock_way(model):
        return model(
            hidden_states=batch.hidden_states,
            encoder_hidden_states=batch.encoder_hidden_states,
            encoder_hidden_states_mask=batch.encoder_mask,
            timestep=sigma,
            img_shapes=batch.img_shapes,
            return_dict=False,
        )[0]

    ref = called_the_stock_way(stock)
    assert torch.equal(out, ref)
    # Called the stock way after install (what a diffusers pipeline does), it is the stock model too.
    assert torch.equal(called_the_stock_way(multi), ref)


@torch.no_grad()
def test_mixed_batch_matches_each_sample_alone(models):
    stock, multi = models
    samples = make_samples(MIXED)
    batch = batch_of(samples)
    assert not batch.image_mask.all() and not batch.encoder_mask.all()  # really padded, both streams
    out = multires_forward(multi, batch, SIGMAS)
    for i, sample in enumerate(samples):
        n = int(batch.image_mask[i].sum())
        ref = stock_alone(stock, sample, SIGMAS[i])
        assert rel_err(out[i, :n], ref) <= 1e-5, f"sample {i}"
        assert torch.equal(out[i, n:], torch.zeros_like(out[i, n:])), f"sample {i}: padding not exactly 0"
        assert torch.equal(target_outputs(out, batch)[i], out[i, : prod(sample["shapes"][0])])
    # The check can fail: the stock RoPE (first sample's shapes for all) is wrong for the others.
    n1 = int(batch.image_mask[1].sum())
    wrong = stock(
        hidden_states=batch.hidden_states[:2, :n1],
        encoder_hidden_states=batch.encoder_hidden_states[:2],
        encoder_hidden_states_mask=batch.encoder_mask[:2],
        timestep=SIGMAS[:2],
        img_shapes=[s["shapes"] for s in samples[1:2]] * 2,
        return_dict=False,
    )[0]
    assert rel_err(wrong[0, :n1], out[0, :n1]) > 1e-3


@torch.no_grad()
def test_masked_but_unpadded_equals_unmasked(models):
    stock, multi = models
    # Different shapes, equal token counts and text lengths: per-sample RoPE, no padding anywhere.
    spec = [((4, 6), [(2, 3)], 6), ((6, 4), [(3, 2)], 6), ((3, 8), [(6, 1)], 6), ((8, 3), [(1, 6)], 6)]
    samples = make_samples(spec)
    batch = batch_of(samples)
    assert batch.image_mask.all() and batch.encoder_mask.all()
    unmasked = multires_forward(multi, batch, SIGMAS[:4])
    all_true = {"image_mask": batch.image_mask.clone()}
    masked = multires_forward(multi, batch, SIGMAS[:4], attention_kwargs=all_true)
    assert rel_err(masked, unmasked) <= 1e-6
    for i, sample in enumerate(samples):
        assert rel_err(unmasked[i], stock_alone(stock, sample, SIGMAS[i])) <= 1e-5


def test_gradients_at_padded_inputs_are_zero_and_valid_gradients_match(models):
    stock, multi = models
    samples = make_samples(MIXED)
    batch = batch_of(samples)
    hidden = batch.hidden_states.clone().requires_grad_(True)
    text = batch.encoder_hidden_states.clone().requires_grad_(True)
    batch.hidden_states, batch.encoder_hidden_states = hidden, text
    out = multires_forward(multi, batch, SIGMAS)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weights).sum().backward()
    assert torch.equal(hidden.grad[~batch.image_mask], torch.zeros_like(hidden.grad[~batch.image_mask]))
    assert torch.equal(text.grad[~batch.encoder_mask], torch.zeros_like(text.grad[~batch.encoder_mask]))
    for i, sample in enumerate(samples):
        n, t = int(batch.image_mask[i].sum()), int(batch.encoder_mask[i].sum())
        h = hidden.detach()[i, :n].clone().requires_grad_(True)
        p = text.detach()[i, :t].clone().requires_grad_(True)
        (stock_alone(stock, sample, SIGMAS[i], hidden=h, prompt=p) * weights[i, :n]).sum().backward()
        assert rel_err(hidden.grad[i, :n], h.grad) <= 1e-5
        assert rel_err(text.grad[i, :t], p.grad) <= 1e-5


def _loss_and_param_grads(forward_outputs, targets, params):
    loss = sum(((o - t) ** 2).mean() for o, t in zip(forward_outputs, targets)) / len(targets)
    grads = torch.autograd.grad(loss, params)
    return loss, grads


def _trained_params(model, with_lora: bool) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if ("lora_" in n if with_lora else "attn.to_q" in n)]


@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
def test_training_step_with_checkpointing_matches_stock(models, with_lora):
    """Gradient checkpointing (+ a peft LoRA): batched loss and parameter gradients equal the stock per-sample sum."""
    stock, multi = (copy.deepcopy(m) for m in models)
    if with_lora:
        lora = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False)
        torch.manual_seed(7)
        stock.add_adapter(lora)
        multi.add_adapter(lora)
        multi.load_state_dict(stock.state_dict())  # identical LoRA weights
    for m in (stock, multi):
        m.train()
        m.enable_gradient_checkpointing()
    assert multi.gradient_checkpointing and is_installed(multi)
    samples = make_samples(MIXED)
    batch = batch_of(samples)
    targets = [torch.randn_like(s["target"]) for s in samples]

    out = multires_forward(multi, batch, SIGMAS)
    loss, grads = _loss_and_param_grads(target_outputs(out, batch), targets, _trained_params(multi, with_lora))
    alone = [stock_alone(stock, s, SIGMAS[i])[: prod(s["shapes"][0])] for i, s in enumerate(samples)]
    ref_loss, ref_grads = _loss_and_param_grads(alone, targets, _trained_params(stock, with_lora))

    assert len(grads) == len(ref_grads) > 0
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) <= 1e-5
    if with_lora:  # the adapter really is in the path
        assert all(isinstance(p, MaskedJointAttnProcessor) for p in multi.attn_processors.values())
        assert any(g.abs().max() > 0 for g in grads)



def test_the_stock_processor_is_the_one_our_copy_was_derived_from():
    """MaskedJointAttnProcessor.__call__ is the stock processor plus a mask, per-sample RoPE and a kernel choice:
    when the installed diffusers' processor changes, this fails loudly (the copy must be re-derived)."""
    from diffusers import __version__

    from models.multires import STOCK_PROCESSOR_AST, stock_processor_ast

    assert stock_processor_ast() == STOCK_PROCESSOR_AST, (
        f"diffusers {__version__} changed QwenDoubleStreamAttnProcessor2_0.__call__: re-derive "
        "models/multires.MaskedJointAttnProcessor.__call__ from it (keep only the marked differences), run "
        "this file, then set STOCK_PROCESSOR_AST to stock_processor_ast()")


def test_the_pin_sees_a_changed_processor(monkeypatch):
    from diffusers.models.transformers import transformer_qwenimage as stock

    from models.multires import STOCK_PROCESSOR_AST, stock_processor_ast

    original = stock.QwenDoubleStreamAttnProcessor2_0.__call__

    def changed(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                attention_mask=None, image_rotary_emb=None):
        """A docstring does not count; a changed statement does."""
        return original(self, attn, hidden_states * 2, encoder_hidden_states, encoder_hidden_states_mask,
                        attention_mask, image_rotary_emb)

    monkeypatch.setattr(stock.QwenDoubleStreamAttnProcessor2_0, "__call__", changed)
    assert stock_processor_ast() != STOCK_PROCESSOR_AST
