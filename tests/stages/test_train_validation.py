"""Validation while training: `train.validate_every` logs the held-out loss (evaluate's protocol: fixed val subset,
noise seeds and σ grid) to TensorBoard, `train.sample_every` writes PNG grids + TensorBoard images, and neither
changes what is trained: with LoRA dropout on (the global RNG matters), a straight run without validation, one
with it, and a stopped + resumed one with it give the identical LoRA."""

from __future__ import annotations

import torch
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import load_config
from stages.train.recipe import run
from train_store import make_train_store, mixed_specs, open_split

SETS = {"train.device": "cpu", "train.batch_size": 2, "train.learning_rate": 5e-3, "train.lora.rank": 4,
        "train.lora.dropout": 0.2, "train.sigma.sampling": "uniform", "train.checkpoint_every": 2}
VAL = {"train.validate_every": 1, "train.sample_every": 2, "train.sample_steps": 2, "train.sample_count": 2,
       "train.validate_max_samples": 2}


def _lora(run_dir):
    return load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors")


def test_validation_logs_samples_and_does_not_change_training(tiny_edit_model, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from models.flow import flow_loss
    from models.lora import load_lora
    from models.randomness import eval_noise
    from stages.train.data import load
    from stages.train.recipe import setup_transformer

    store = tmp_path / "store"
    make_train_store(store, tiny_edit_model, mixed_specs(5, 3))
    plain = tmp_path / "plain"
    run(load_config(None, {**SETS, "train.max_steps": 4}), store, tiny_edit_model, plain)

    validated = tmp_path / "validated"
    args = ["run", "train", "--store", str(store), "--model", tiny_edit_model, "--out", str(validated),
            "--max-steps", "4", *[x for k, v in {**SETS, **VAL}.items() for x in ("--set", f"{k}={v}")]]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    resumed = tmp_path / "resumed"
    run(load_config(None, {**SETS, **VAL, "train.max_steps": 2}), store, tiny_edit_model, resumed)
    run(load_config(None, {**SETS, **VAL, "train.max_steps": 4}), store, tiny_edit_model, resumed, resume=True)

    a, b, c = _lora(plain), _lora(validated), _lora(resumed)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)

    ea = EventAccumulator(str(validated / "logs"), size_guidance={"images": 0})
    ea.Reload()
    val = ea.Scalars("val/loss")
    assert [e.step for e in val] == [1, 2, 3, 4]
    assert [e.step for e in ea.Images("samples/grid")] == [2, 4]
    # the logged value at step 4 is the held-out loss of the final LoRA on the first 2 val keys (one batch here)
    tables = open_split(store, tiny_edit_model, split="val")  # as the validator opens it
    samples = [load(tables, k) for k in sorted(tables.keys)[:2]]
    cfg = load_config(None, SETS).train
    model = setup_transformer(tiny_edit_model, cfg, torch.device("cpu")).eval()
    load_lora(model, validated / "lora")
    rows = [(s, seed, t) for s in samples for seed in cfg.validate_noise_seeds for t in cfg.validate_timesteps]
    with torch.no_grad():
        ref = flow_loss(model, [s for s, _, _ in rows], torch.tensor([t for *_, t in rows]),
                        [eval_noise(s, seed) for s, seed, _ in rows]).mean()
    assert abs(val[-1].value - float(ref)) < 1e-5
    for step in (2, 4):
        grid = Image.open(validated / "samples" / f"step-{step:06d}.png")
        assert grid.size == (sum(s.img_shapes[0][2] * 16 for s in samples), max(s.img_shapes[0][1] * 16 for s in samples))
