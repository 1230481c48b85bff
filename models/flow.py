"""Flow matching as in Qwen-Image (DESIGN §6): sigma sampling, noising, target, per-sample normalised loss.

x_t = (1-σ)·x0 + σ·ε, the model predicts ε − x0. The transformer takes σ itself as `timestep` (t/1000, the
diffusers edit-pipeline convention). Train and evaluate both use these functions.

Sigma sampling (`SigmaConfig.sampling`):
- uniform: σ ~ U(0, 1);
- logit_normal: σ = sigmoid(N(logit_mean, logit_std)) (SD3 / Qwen-Image training default);
- shift: u ~ U(0, 1) pushed by the static shift s: σ = s·u / (1 + (s−1)·u);
- dynamic_shift: u ~ U(0, 1) pushed by the resolution-dependent exponential time shift of the real scheduler:
  mu = calculate_shift(image_seq_len) (linear between base_shift at base_image_seq_len and max_shift at
  max_image_seq_len, as diffusers' pipelines compute it), σ = e^mu / (e^mu + (1/u − 1)). image_seq_len is the
  sample's target token count (what the pipelines pass: the packed latent length). Uniform u then shift is
  the distribution of the inference schedule's σs; the scheduler's `shift_terminal` stretch only shapes the
  inference grid and is not applied here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from torch import Tensor

from models.multires import PackedBatch, _unwrap, build_batch, multires_forward, pack_latents, target_outputs

if TYPE_CHECKING:
    from models.sample import TrainSample


class SigmaSettings(Protocol):
    """What `sample_sigmas` reads (`schemas.config.SigmaConfig` has exactly these fields)."""

    sampling: str
    logit_mean: float
    logit_std: float
    shift: float
    base_shift: float
    max_shift: float
    base_image_seq_len: int
    max_image_seq_len: int


def time_shift_exponential(mu: Tensor, u: Tensor) -> Tensor:
    """e^mu / (e^mu + (1/u − 1)), written as e^mu·u / (e^mu·u + 1 − u) so u = 0 gives 0, not a division by zero."""
    e = torch.exp(mu)
    return e * u / (e * u + (1 - u))


def sample_sigmas(n: int, cfg: SigmaSettings, generator: torch.Generator, image_seq_lens: list[int]) -> Tensor:
    """[n] float32 sigmas in [0, 1] on the generator's device; deterministic given the generator state.

    image_seq_lens: per sample target token count (used by dynamic_shift only; must have n entries then).
    """
    device = generator.device
    if cfg.sampling == "logit_normal":
        z = torch.randn(n, generator=generator, device=device, dtype=torch.float32)
        return torch.sigmoid(z * cfg.logit_std + cfg.logit_mean)
    u = torch.rand(n, generator=generator, device=device, dtype=torch.float32)
    if cfg.sampling == "uniform":
        return u
    if cfg.sampling == "shift":
        return cfg.shift * u / (1 + (cfg.shift - 1) * u)
    if cfg.sampling == "dynamic_shift":
        if len(image_seq_lens) != n:
            raise ValueError(f"dynamic_shift needs one image_seq_len per sample: got {len(image_seq_lens)} for {n}")
        seq = torch.tensor(image_seq_lens, dtype=torch.float32, device=device)
        mu = calculate_shift(seq, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift)
        return time_shift_exponential(mu, u)
    raise ValueError(f"unknown sigma sampling {cfg.sampling!r}")


def _per_sample(sigma: Tensor, x: Tensor) -> Tensor:
    """Broadcast sigma ([] or [B]) against x ([B, ...] or any shape for a scalar)."""
    sigma = sigma.to(device=x.device, dtype=x.dtype) if torch.is_floating_point(x) else sigma.to(x.device)
    if sigma.ndim == 0:
        return sigma
    return sigma.reshape(-1, *([1] * (x.ndim - 1)))


def add_noise(x0: Tensor, noise: Tensor, sigma: Tensor) -> Tensor:
    """x_t = (1-σ)·x0 + σ·ε, σ per sample (leading dim) or a scalar."""
    s = _per_sample(sigma, x0)
    return (1 - s) * x0 + s * noise


def flow_target(x0: Tensor, noise: Tensor) -> Tensor:
    """Velocity target ε − x0."""
    return noise - x0


def per_sample_loss(
    pred: list[Tensor], target: list[Tensor], weights: list[Tensor | None] | None = None
) -> Tensor:
    """[B] float32: each sample's squared error averaged over its own valid tokens (and channels).

    pred[i], target[i]: [N_i, C] (valid target tokens only, so padding contributes nothing).
    weights[i]: optional [N_i] token weights (e.g. `mask_token_weights`): loss_i = Σ_t w_t·mse_t / Σ_t w_t, so
    uniform weights of any value give the unweighted loss. A sample whose weights sum to 0 contributes 0.
    """
    if len(pred) != len(target):
        raise ValueError(f"{len(pred)} predictions for {len(target)} targets")
    losses = []
    for i, (p, t) in enumerate(zip(pred, target)):
        token_se = (p.float() - t.float()).pow(2).mean(dim=-1)  # [N_i]
        w = None if weights is None else weights[i]
        if w is None:
            losses.append(token_se.mean())
            continue
        w = w.to(device=token_se.device, dtype=torch.float32)
        if w.shape != token_se.shape:
            raise ValueError(f"sample {i}: token weights {tuple(w.shape)} do not match {tuple(token_se.shape)} tokens")
        total = w.sum()
        losses.append(torch.where(total > 0, (w * token_se).sum() / total.clamp_min(1e-12), token_se.sum() * 0))
    return torch.stack(losses)


def batch_loss(
    pred: list[Tensor], target: list[Tensor], weights: list[Tensor | None] | None = None
) -> Tensor:
    """Mean over the batch of `per_sample_loss`, so a small image weighs the same as a large one."""
    return per_sample_loss(pred, target, weights).mean()


def mask_token_weights(mask_tokens: Tensor, foreground: float, background: float) -> Tensor:
    """Edit mask in [0, 1] at the token grid ([N] or any shape) -> float32 weights B + (F − B)·mask."""
    m = mask_tokens.float().clamp(0, 1)
    return background + (foreground - background) * m


def flow_loss(
    transformer,
    samples: list[TrainSample],
    sigmas: Tensor,
    noises: list[Tensor],
    use_empty: list[bool] | None = None,
    mask_weight: tuple[float, float] = (1.0, 1.0),
) -> Tensor:
    """Per-sample flow-matching losses [B] (float32) of `transformer` on a mixed-resolution batch.

    The one loss of the project: train and evaluate both call it.
    - samples: `models.sample.TrainSample`s (any sizes, any control counts); their tensors may live on the CPU in bf16.
    - sigmas: [B] noise levels σ in [0, 1]; the transformer gets σ as its timestep (diffusers: t/1000).
    - noises: per sample ε shaped like its target latent [C, 1, h, w] (see `draw_noise` for fixed seeds).
    - use_empty: per sample, True = condition on the stored empty-prompt embeds (caption dropout).
    - mask_weight: (foreground, background) token weights from the sample's stored edit mask; samples
      without a mask, or (1, 1), give the plain loss.
    x_t = (1-σ)·x0 + σ·ε, target ε − x0, loss on the target tokens only, averaged per sample over its own
    valid tokens (padding and control tokens never count). Inputs go in the transformer's dtype and device;
    the flow arithmetic and the loss are float32. Gradients flow to whatever in `transformer` requires them.
    """
    base = _unwrap(transformer)  # DDP / compile wrappers have no .device / .dtype
    fb = prepare_flow_batch(samples, sigmas, noises, use_empty, mask_weight, base.device, base.dtype)
    return flow_loss_of(transformer, fb)


@dataclass
class FlowBatch:
    """Everything `flow_loss` computes before the forward: the packed noised batch, σ, targets, token weights."""

    batch: PackedBatch  # (a `models.qwen21_multires.Qwen21Batch` for Qwen-Image-2.1 samples)
    sigmas: Tensor  # [B] float32
    targets: list[Tensor]  # per sample [N_i, 4C] float32, ε − x0
    weights: list[Tensor | None] | None = None


def prepare_flow_batch(
    samples: list[TrainSample],
    sigmas: Tensor,
    noises: list[Tensor],
    use_empty: list[bool] | None,
    mask_weight: tuple[float, float],
    device: torch.device,
    dtype: torch.dtype,
) -> FlowBatch:
    """The first half of `flow_loss` (see there), computed on `device`: what a prefetch thread can do ahead."""
    if not (len(samples) == len(noises) == sigmas.shape[0]):
        raise ValueError(f"flow_loss: {len(samples)} samples, {len(noises)} noises, {sigmas.shape[0]} sigmas")
    if samples and samples[0].slot_mask is not None:  # Qwen-Image-2.1 samples (models/qwen21_flow.py)
        from models.qwen21_flow import prepare_flow_batch_21

        return prepare_flow_batch_21(samples, sigmas, noises, use_empty, mask_weight, device, dtype)
    sigmas = sigmas.to(device=device, dtype=torch.float32)
    x0 = [pack_latents(s.target).to(device=device, dtype=torch.float32) for s in samples]
    eps = [pack_latents(n).to(device=device, dtype=torch.float32) for n in noises]
    x_t = [add_noise(x, e, s) for x, e, s in zip(x0, eps, sigmas)]
    prompts = [
        (s.empty_embeds if use_empty is not None and use_empty[i] else s.prompt_embeds).to(device)
        for i, s in enumerate(samples)
    ]
    batch = build_batch(
        [x.to(dtype) for x in x_t],
        [[c.to(device) for c in s.controls] for s in samples],
        prompts,
        [s.img_shapes for s in samples],
    )
    targets = [flow_target(x, e) for x, e in zip(x0, eps)]
    weights = None
    if tuple(mask_weight) != (1.0, 1.0):
        weights = [
            mask_token_weights(s.mask_weight, *mask_weight) if s.mask_weight is not None else None for s in samples
        ]
    return FlowBatch(batch, sigmas, targets, weights)


def target_predictions(transformer, fb: FlowBatch) -> list[Tensor]:
    """The forward on a prepared batch: each sample's predictions at its own target tokens."""
    if not isinstance(fb.batch, PackedBatch):  # a Qwen-Image-2.1 batch (models/qwen21_flow.py)
        from models.qwen21_flow import predictions_21

        return predictions_21(transformer, fb.batch, fb.sigmas)
    out = multires_forward(transformer, fb.batch, fb.sigmas.to(_unwrap(transformer).dtype))
    return target_outputs(out, fb.batch)


def flow_loss_of(transformer, fb: FlowBatch) -> Tensor:
    """The second half of `flow_loss`: forward on a prepared batch, per-sample losses [B] (float32)."""
    return per_sample_loss(target_predictions(transformer, fb), fb.targets, fb.weights)
