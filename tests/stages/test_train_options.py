"""Trainer options of issue 15 on the tiny model: optimizers (AdamW, AdamW 8-bit, Adafactor, Prodigy) and adapter
kinds (LoRA, DoRA, LoHa, LoKr) each checkpoint without pickle and resume bit for bit (2 + resume + 2 == 4
straight); what diffusers loads reproduces the trainer's prediction; the EMA adapter is saved as RUN/lora_ema,
resumes exactly and evaluate scores it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import load_config
from stages.train.recipe import run
from train_store import make_train_store, mixed_specs, trainer_vs_stock

BASE = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 5e-3, "train.lora.rank": 4,
        "train.sigma.sampling": "uniform", "train.warmup_steps": 1}


def cfg_of(**train):
    return load_config(None, {**BASE, **{f"train.{k}": v for k, v in train.items()}})


@pytest.fixture(scope="module")
def store_dir(tiny_edit_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("options") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(5, 2))
    return root


def _same_files(a: Path, b: Path, name: str) -> None:
    x, y = load_file(a / name), load_file(b / name)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name


def _straight_vs_resumed(store, model, tmp: Path, **train) -> tuple[Path, Path]:
    straight, resumed = tmp / "straight", tmp / "resumed"
    run(cfg_of(max_steps=4, checkpoint_every=2, **train), store, model, straight)
    run(cfg_of(max_steps=2, checkpoint_every=2, **train), store, model, resumed)
    run(cfg_of(max_steps=4, checkpoint_every=2, **train), store, model, resumed, resume=True)
    for name in ("lora/pytorch_lora_weights.safetensors", "optimizer.safetensors"):
        _same_files(straight / "checkpoints" / "step-4", resumed / "checkpoints" / "step-4", name)
    a, b = (p / "checkpoints" / "step-4" / "optimizer.json" for p in (straight, resumed))
    assert a.read_text() == b.read_text()
    _same_files(straight, resumed, "lora/pytorch_lora_weights.safetensors")
    return straight, resumed


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adafactor", "prodigy"])
def test_optimizers_resume_bit_for_bit(optimizer, store_dir, tiny_edit_model, tmp_path):
    lr = {"prodigy": 1.0}.get(optimizer, 5e-3)
    straight, _ = _straight_vs_resumed(store_dir, tiny_edit_model, tmp_path, optimizer=optimizer, learning_rate=lr)
    state = load_file(straight / "checkpoints" / "step-4" / "optimizer.safetensors")
    kinds = {"adamw": "exp_avg_sq", "adamw8bit": "state2", "adafactor": "exp_avg_sq_row", "prodigy": "p0"}
    assert any(k.endswith(kinds[optimizer]) for k in state), sorted(state)[:6]
    if optimizer == "adamw8bit":
        assert any(v.dtype == torch.uint8 for v in state.values())  # 8-bit states really are 8 bit
    lora = load_file(straight / "lora" / "pytorch_lora_weights.safetensors")
    assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)  # it trained


def _prediction_pair(model: str, store: Path, lora_dir: Path, rank: int = 4):
    """(trainer's prediction with the adapter, diffusers pipeline + load_lora_weights, stock base)."""
    from models.lora import attach_lora
    from models.loading import load_component
    from models.multires import install_multires

    ours_model = load_component(model, "transformer")
    install_multires(ours_model)
    attach_lora(ours_model, lora_dir)
    return trainer_vs_stock(model, store, ours_model, lora_dir)

@pytest.mark.parametrize("kind", ["lora", "dora", "loha", "lokr"])
def test_adapter_kinds_train_resume_and_save(kind, store_dir, tiny_edit_model, tmp_path):
    straight, _ = _straight_vs_resumed(store_dir, tiny_edit_model, tmp_path, **{"lora.kind": kind})
    sd = load_file(straight / "lora" / "pytorch_lora_weights.safetensors")
    tag = {"lora": "lora_B", "dora": "lora_magnitude_vector", "loha": "hada_w1_a", "lokr": "lokr_w1"}[kind]
    assert any(tag in k for k in sd), sorted(sd)[:4]
    if kind in ("lora", "dora"):  # diffusers' Qwen-Image loader reads these: same prediction as the trainer
        ours, theirs, base = _prediction_pair(tiny_edit_model, store_dir, straight / "lora")
        assert not torch.equal(theirs, base)
        torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=1e-6)
    else:  # peft format (docs/train.md): diffusers refuses it, the project's own loader reads it back
        from diffusers import QwenImageEditPipeline

        with pytest.raises(Exception):
            QwenImageEditPipeline.from_pretrained(tiny_edit_model).load_lora_weights(straight / "lora")
        from models.lora import attach_lora
        from models.loading import load_component

        t = load_component(tiny_edit_model, "transformer")
        attach_lora(t, straight / "lora")
        assert type(t.transformer_blocks[0].attn.to_q).__module__ == f"peft.tuners.{kind}.layer"


def test_ema_is_saved_resumed_and_scored(store_dir, tiny_edit_model, tmp_path):
    straight, resumed = _straight_vs_resumed(store_dir, tiny_edit_model, tmp_path, ema_decay=0.5)
    _same_files(straight / "checkpoints" / "step-4", resumed / "checkpoints" / "step-4", "ema.safetensors")
    _same_files(straight, resumed, "lora_ema/pytorch_lora_weights.safetensors")
    # The EMA after 4 steps with decay 0.5 is a weighted mean of the adapter's trajectory (warmed up: step 1's
    # adapter its start, the init none; test_ema_warms_up_as_diffusers_ema_model_across_a_resume has the weights).
    ckpts = {s: load_file(straight / "checkpoints" / f"step-{s}" / "lora" / "pytorch_lora_weights.safetensors")
             for s in (2, 4)}
    ema = load_file(straight / "lora_ema" / "pytorch_lora_weights.safetensors")
    final = load_file(straight / "lora" / "pytorch_lora_weights.safetensors")
    assert ema.keys() == final.keys() and torch.equal(final[next(iter(final))], ckpts[4][next(iter(final))])
    assert all(not torch.equal(ema[k], final[k]) for k in ema if "lora_B" in k)
    b = [k for k in ema if "lora_B" in k][0]
    assert (ema[b] - final[b]).abs().max() < (final[b]).abs().max()  # between 0 (B init) and the final B
    # evaluate scores it like any LoRA folder
    result = CliRunner().invoke(app, ["run", "evaluate", "--store", str(store_dir), "--model", tiny_edit_model,
                                      "--lora", str(straight / "lora_ema"), "--out", str(tmp_path / "report"),
                                      "--num-samples", "0", "--set", "evaluate.noise_seeds=[0]",
                                      "--set", "evaluate.timesteps=[0.5]"])
    assert result.exit_code == 0, result.output
    assert "LoRA" in result.output


def test_ema_warms_up_as_diffusers_ema_model_across_a_resume(store_dir, tiny_edit_model, tmp_path):
    """RUN/lora_ema is what diffusers' `EMAModel` (its default warm-up, the decay capped at (1+k)/(10+k)) makes of
    the adapter after each optimizer step, computed in float64 here from the checkpoints of steps 1..5, with a
    resume after step 3 (the warm-up counts optimizer steps, not steps of this start). Before: a fixed decay from
    the init LoRA, so at 0.999 a 1000-step run's EMA was still 37 % the untrained init."""
    from diffusers.training_utils import EMAModel

    out, decay = tmp_path / "run", 0.3  # 0.3: the cap binds from step 4 (4/13 > 0.3), the warm-up before it
    run(cfg_of(max_steps=3, checkpoint_every=1, keep_checkpoints=10, ema_decay=decay), store_dir, tiny_edit_model, out)
    run(cfg_of(max_steps=5, checkpoint_every=1, keep_checkpoints=10, ema_decay=decay), store_dir, tiny_edit_model, out,
        resume=True)
    trajectory = [load_file(out / "checkpoints" / f"step-{s}" / "lora" / "pytorch_lora_weights.safetensors")
                  for s in range(1, 6)]
    keys = sorted(trajectory[0])
    params = [torch.nn.Parameter(torch.zeros_like(trajectory[0][k], dtype=torch.float64)) for k in keys]
    reference = EMAModel(params, decay=decay)
    for weights in trajectory:
        with torch.no_grad():
            for p, k in zip(params, keys):
                p.copy_(weights[k].double())
        reference.step(params)
    assert reference.cur_decay_value == decay
    ema = load_file(out / "lora_ema" / "pytorch_lora_weights.safetensors")
    assert sorted(ema) == keys
    for k, expected in zip(keys, reference.shadow_params):
        torch.testing.assert_close(ema[k].double(), expected, rtol=1e-6, atol=1e-9,
                                   msg=lambda m, k=k: f"{k}: {m}")
    assert any(not torch.equal(ema[k], trajectory[-1][k]) for k in keys if "lora_B" in k)  # an average, not the last
