"""Qwen-Image-Edit-2511 end to end through the CLI: `make-tiny-model --variant edit-2511` (the Plus pipeline over
a transformer with `zero_cond_t`), encode-text, encode-vae, train, evaluate, predict; the trained LoRA loaded in
the unmodified `QwenImageEditPlusPipeline` reproduces the trainer's prediction bit for bit."""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image
from typer.testing import CliRunner

from pipeline.cli import app


def _cli(*args) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def test_edit_2511_end_to_end(plus_store, tmp_path):
    from diffusers import QwenImageEditPlusPipeline

    from models.loading import model_variant, pipeline_family
    from models.lora import load_lora
    from models.multires import build_batch, multires_forward, pack_latents
    from models.randomness import draw_noise
    from pipeline.config import load_config
    from stages.train.data import load
    from train_store import open_split
    from stages.train.recipe import setup_transformer

    model = tmp_path / "tiny-2511"
    _cli("make-tiny-model", model, "--variant", "edit-2511")
    assert json.loads((model / "transformer" / "config.json").read_text())["zero_cond_t"] is True
    assert model_variant(str(model)) == "edit-2511" and pipeline_family("edit-2511") == "edit-plus"

    _cli("run", "encode-text", "--store", plus_store, "--model", model)
    _cli("run", "encode-vae", "--store", plus_store, "--model", model)
    run_dir = tmp_path / "run"
    sets = ["--set", "train.learning_rate=0.02", "--set", "train.lora.rank=4"]
    _cli("run", "train", "--store", plus_store, "--model", model, "--out", run_dir, "--max-steps", 2,
         "--batch-size", 2, "--device", "cpu", *sets)
    _cli("run", "evaluate", "--store", plus_store, "--model", model, "--lora", run_dir / "lora",
         "--out", tmp_path / "report", "--num-samples", 1, "--steps", 2,
         "--set", "evaluate.noise_seeds=[0]", "--set", "evaluate.timesteps=[0.5]")
    assert (tmp_path / "report" / "metrics.json").is_file()
    Image.fromarray((np.random.default_rng(0).random((48, 64, 3)) * 255).astype("uint8")).save(tmp_path / "c.png")
    _cli("predict", "--model", model, "--lora", run_dir / "lora", "--image", tmp_path / "c.png", "--prompt",
         "make the square red", "--steps", 2, "--height", 32, "--width", 32, "--out", tmp_path / "p.png")
    assert Image.open(tmp_path / "p.png").size == (32, 32)

    # The trainer's prediction on a stored sample with controls == stock Edit-Plus pipeline + the LoRA.
    cfg = load_config(None, {"train.lora.rank": 4})
    tables = open_split(plus_store, str(model))
    sample = next(s for s in (load(tables, k) for k in tables.keys) if s.controls)
    x_t = pack_latents(sample.target).float() * 0.6 + pack_latents(draw_noise(sample, 0, 0)) * 0.4
    sigma = torch.tensor([0.4])
    ours_model = setup_transformer(str(model), cfg.train, torch.device("cpu")).eval()
    load_lora(ours_model, run_dir / "lora")
    batch = build_batch([x_t], [list(sample.controls)], [sample.prompt_embeds], [sample.img_shapes])
    with torch.no_grad():
        ours = multires_forward(ours_model, batch.to("cpu", torch.float32), sigma)[0, : x_t.shape[0]]

    pipe = QwenImageEditPlusPipeline.from_pretrained(model)
    assert pipe.transformer.config.zero_cond_t
    tokens = torch.cat([x_t] + [pack_latents(c).float() for c in sample.controls])[None]

    def stock() -> torch.Tensor:
        with torch.no_grad():
            return pipe.transformer(hidden_states=tokens, encoder_hidden_states=sample.prompt_embeds.float()[None],
                                    timestep=sigma, img_shapes=[sample.img_shapes], return_dict=False)[0][0, : x_t.shape[0]]

    base = stock()
    pipe.load_lora_weights(run_dir / "lora")
    theirs = stock()
    assert not torch.equal(theirs, base)
    assert torch.equal(ours, theirs)
