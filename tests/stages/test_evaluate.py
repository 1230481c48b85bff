"""evaluate: generation from stored features equals the unmodified diffusers pipeline, base and LoRA.

The held-out loss (per bucket, inside/outside the edit mask) and the written report are checked end to end on
a real store in tests/pipeline/test_run_all.py; the page itself in tests/pipeline/test_report_html.py."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from PIL import Image

from models.loading import load_component
from models.lora import save_lora
from models.multires import install_multires
from schemas.config import EvaluateConfig
from stages.evaluate.checkpoint_report import _Job
from stages.evaluate.sample_images import conditioning, paired_rows
from models.lora import attach_lora
from models.sample import TrainSample
from lora_writer import add_random_b_lora


@pytest.fixture(scope="module")
def tiny_lora(tiny_edit_model, tmp_path_factory):
    """A LoRA written by the trainer's own saver (alpha != rank, non-zero B so it changes outputs)."""
    transformer = load_component(tiny_edit_model, "transformer")
    add_random_b_lora(transformer)
    out = tmp_path_factory.mktemp("lora") / "lora"
    save_lora(transformer, out)
    return str(out)


def _stored_sample() -> TrainSample:
    """Features as the store holds them (bf16): a 64x48 target and one control at the stock ~1024² size."""
    g = torch.Generator().manual_seed(0)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    return TrainSample(
        key="k" * 32,
        target=bf(4, 1, 8, 6),
        controls=[bf(4, 1, 128, 128)],
        prompt_embeds=bf(9, 32),
        empty_embeds=bf(5, 32),
        img_shapes=[(1, 4, 3), (1, 64, 64)],
    )


def test_generation_from_stored_features_equals_stock_pipeline(tiny_edit_model, tiny_lora):
    """Evaluate's path (stored embeds + control latents, multires-installed transformer with the LoRA attached
    through peft, own Euler loop with true CFG and norm rescale, VAE decode) gives exactly the image of the
    stock `QwenImageEditPipeline.__call__` fed the same embeds and control latents, base and LoRA."""
    from diffusers import QwenImageEditPipeline

    sample = _stored_sample()
    cfg = EvaluateConfig(num_inference_steps=2, true_cfg_scale=3.0, seed=7)
    transformer = load_component(tiny_edit_model, "transformer")
    install_multires(transformer)
    attach_lora(transformer, tiny_lora, scale=1.0)
    vae = load_component(tiny_edit_model, "vae")
    sched = dict(load_component(tiny_edit_model, "scheduler").config)
    job = _Job("k", "", [], None, conditioning(sample, "cpu", torch.float32), 64, 48, sched)
    (row,) = paired_rows([job], transformer, vae, cfg, qwen21=False)  # evaluate's own base / LoRA pair
    base, lora = row.base, row.lora

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model)
    # The one input seam: the stored control latent instead of a VAE encode (instance attribute, class untouched).
    pipe._encode_vae_image = lambda image, generator: sample.controls[0][None].float()
    control = Image.new("RGB", (1024, 1024))  # stock sizes its control to ~1024²: 1024x1024 -> 128x128 latent

    def stock() -> np.ndarray:
        out = pipe(image=control, prompt_embeds=sample.prompt_embeds[None].float(),
                   negative_prompt_embeds=sample.empty_embeds[None].float(), true_cfg_scale=3.0,
                   num_inference_steps=2, height=64, width=48, generator=torch.Generator().manual_seed(7))
        return np.asarray(out.images[0])

    ref_base = stock()
    pipe.load_lora_weights(tiny_lora)
    ref_lora = stock()
    np.testing.assert_array_equal(np.asarray(base), ref_base)
    np.testing.assert_array_equal(np.asarray(lora), ref_lora)
    assert np.abs(ref_lora.astype(int) - ref_base.astype(int)).max() > 0  # the LoRA changes the image
