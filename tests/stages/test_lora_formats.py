"""LoRA files in other formats: `pipeline lora export --format comfyui` (keys + per-module alphas that ComfyUI's
Qwen-Image loader maps; diffusers' own converter for that format reproduces the trainer's prediction), and
`train.init_lora` from the diffusers, ComfyUI and kohya formats (the starting adapter is the file's delta)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.config import load_config
from train_store import make_train_store, mixed_specs, trainer_vs_stock

TRAIN = ["--set", "train.learning_rate=0.02", "--set", "train.lora.rank=4", "--set", "train.lora.alpha=8",
         "--set", "train.sigma.sampling=uniform", "--set", "train.checkpoint_every=2"]


def _cli(*args, code: int = 0) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture(scope="module")
def trained(tiny_edit_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    make_train_store(root / "store", tiny_edit_model, mixed_specs(6, 2))
    _cli("run", "train", "--store", root / "store", "--model", tiny_edit_model, "--out", root / "run",
         "--max-steps", 2, "--batch-size", 3, "--device", "cpu", *TRAIN)
    return root


def _trainer_and_stock(model: str, store: Path, lora_for_trainer: Path, lora_for_stock: Path):
    """(trainer's prediction with its LoRA, stock pipeline's prediction with `lora_for_stock`, stock base)."""
    from models.lora import load_lora
    from stages.train.recipe import setup_transformer

    cfg = load_config(None, {"train.lora.rank": 4, "train.lora.alpha": 8})
    ours_model = setup_transformer(model, cfg.train, torch.device("cpu")).eval()
    load_lora(ours_model, lora_for_trainer)
    return trainer_vs_stock(model, store, ours_model, lora_for_stock)

def test_comfyui_export_loads_in_diffusers_and_reproduces_the_trainer(trained, tiny_edit_model, tmp_path):
    out = tmp_path / "comfy.safetensors"
    _cli("lora", "export", trained / "run" / "lora", "--format", "comfyui", "--out", out)
    sd = load_file(out)
    assert all(k.startswith("diffusion_model.transformer_blocks.") for k in sd)
    alphas = {k: v for k, v in sd.items() if k.endswith(".alpha")}
    # the final LoRA has alpha / r folded into lora_up: alpha = rank here
    assert len(alphas) == 2 * 4 and all(v.ndim == 0 and float(v) == 4.0 for v in alphas.values())  # 2 blocks x 4
    assert {k.rsplit(".", 2)[-2] for k in sd if k.endswith(".weight")} == {"lora_down", "lora_up"}

    from diffusers import QwenImagePipeline

    converted = QwenImagePipeline.lora_state_dict(str(out))  # diffusers' converter for this format
    assert all(k.startswith("transformer.") and k.endswith(("lora_A.weight", "lora_B.weight")) for k in converted)
    # the trainer with its exact (unfolded, alpha 8) values of the last checkpoint
    ours, theirs, base = _trainer_and_stock(tiny_edit_model, trained / "store",
                                            trained / "run" / "checkpoints" / "step-2" / "lora", out)
    assert not torch.equal(theirs, base)
    torch.testing.assert_close(theirs, ours, rtol=1e-6, atol=1e-6)  # alpha/r baked into A and B: fp32 rounding
    _cli("lora", "export", trained / "run" / "lora", "--format", "a1111", "--out", out, code=1)


def _kohya(comfy: Path, out: Path) -> Path:
    """The same LoRA with kohya's flat `lora_unet_*` module names (what musubi/kohya scripts write)."""
    sd = load_file(comfy)
    renamed = {}
    for k, v in sd.items():
        module, suffix = k[len("diffusion_model."):].split(".lora_") if ".lora_" in k else (k[len("diffusion_model."):-len(".alpha")], None)
        name = "lora_unet_" + module.replace(".", "_")
        renamed[f"{name}.lora_{suffix}" if suffix else f"{name}.alpha"] = v
    save_file(renamed, out)
    return out


def test_init_lora_from_diffusers_comfyui_and_kohya_files(trained, tiny_edit_model, tmp_path):
    from diffusers import QwenImageEditPipeline

    from stages.train.recipe import setup

    src = trained / "run" / "lora"
    comfy = tmp_path / "comfy.safetensors"
    _cli("lora", "export", src, "--format", "comfyui", "--out", comfy)
    kohya = _kohya(comfy, tmp_path / "kohya.safetensors")
    assert next(iter(load_file(kohya))).startswith("lora_unet_transformer_blocks_")

    pipe = QwenImageEditPipeline.from_pretrained(tiny_edit_model)
    pipe.load_lora_weights(src, adapter_name="ref")
    ref = {n: m.get_delta_weight("ref") for n, m in pipe.transformer.named_modules() if hasattr(m, "get_delta_weight")}
    assert any(d.abs().max() > 0 for d in ref.values())
    # config alpha 4 (= rank) while the diffusers file says 8: the starting delta is still the file's
    for i, f in enumerate((src, comfy, kohya)):
        cfg = load_config(None, {"train.device": "cpu", "train.lora.rank": 4, "train.init_lora": str(f)})
        r = setup(cfg, trained / "store", tiny_edit_model, tmp_path / f"setup{i}", resume=False)
        mine = {n: m.get_delta_weight("default") for n, m in r.transformer.named_modules() if hasattr(m, "get_delta_weight")}
        assert mine.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(mine[n], ref[n], rtol=1e-6, atol=1e-7)
        r.writer.close()

    # through the CLI: trains from the kohya file; a rank that does not match is one line naming the setting
    _cli("run", "train", "--store", trained / "store", "--model", tiny_edit_model, "--out", tmp_path / "run",
         "--max-steps", 1, "--device", "cpu", "--set", f"train.init_lora={kohya}", "--set", "train.lora.rank=4")
    out = _cli("run", "train", "--store", trained / "store", "--model", tiny_edit_model, "--out", tmp_path / "run2",
               "--max-steps", 1, "--device", "cpu", "--set", f"train.init_lora={kohya}", code=1)
    assert "train.lora.rank" in out
