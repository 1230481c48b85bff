"""Attach a saved LoRA to a transformer (evaluate, merge) and bake it into a standalone model folder.

A merged folder is the original model folder with only `transformer/` replaced by base + scale·LoRA weights;
every other component is linked (or copied) unchanged, so plain diffusers loads it like the original and a
7B text encoder is never loaded just to be written back.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from models.loading import load_component, parse_dtype, resolve_model
from schemas.errors import UserError

WEIGHT_NAME = "pytorch_lora_weights.safetensors"
ADAPTER = "lora"


def lora_weight_file(lora: str | Path) -> Path:
    path = Path(lora)
    path = path / WEIGHT_NAME if path.is_dir() else path
    if not path.is_file() or path.suffix != ".safetensors":
        raise UserError(
            f"no LoRA weights at {path}: pass a folder written by `pipeline run train` (RUN/lora) "
            f"holding {WEIGHT_NAME}, or the .safetensors file itself"
        )
    return path


def attach_lora(transformer, lora: str | Path, scale: float = 1.0, adapter_name: str = ADAPTER) -> None:
    """Load a diffusers-format LoRA into the transformer (peft), active at `scale`."""
    path = lora_weight_file(lora)
    transformer.load_lora_adapter(str(path.parent), weight_name=path.name, prefix="transformer",
                                  adapter_name=adapter_name)
    if not any(adapter_name in getattr(m, "lora_A", {}) for m in transformer.modules()):
        raise UserError(f"{path} holds no LoRA weights for this transformer's modules (wrong model?)")
    transformer.set_adapters([adapter_name], weights=[scale])


def saved_dtype(model: str) -> torch.dtype:
    """Dtype of the model's stored transformer weights (merge writes back what it read)."""
    folder = resolve_model(model) / "transformer"
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                return _st_dtype(st.get_slice(key).get_dtype())
    return torch.float32


def _st_dtype(name: str) -> torch.dtype:
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(name, torch.float32)


def _link_or_copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        dst.mkdir(parents=True, exist_ok=True)
        for child in src.iterdir():
            _link_or_copy(child, dst / child.name)
        return
    real = src.resolve()  # hub snapshots are symlinks into the blob cache: link the blob itself
    try:
        os.link(real, dst)  # same filesystem: no copy of multi-GB weights
    except OSError:
        shutil.copy2(real, dst)


def merge_lora(model: str, lora: str | Path, out: str | Path, scale: float = 1.0, dtype: str | None = None,
               device: str = "cpu") -> Path:
    """Write OUT: MODEL with transformer weights W + scale·(B·A)·alpha/r fused in. Refuses a non-empty OUT.
    The transformer loads straight onto `device` (a GPU fuses a 20B model in seconds; host RAM holds no copy)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"output folder {out} exists and is not empty; pass a new folder")
    root = resolve_model(model)
    torch_dtype = parse_dtype(dtype, device) if dtype else saved_dtype(model)
    transformer = load_component(model, "transformer", dtype=torch_dtype, device=device)
    attach_lora(transformer, lora, scale=1.0)
    transformer.fuse_lora(lora_scale=scale, adapter_names=[ADAPTER])
    transformer.unload_lora()  # drops the peft layers, keeps the fused base weights

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for child in root.iterdir():
        if child.name != "transformer":
            _link_or_copy(child, tmp / child.name)
    transformer.save_pretrained(tmp / "transformer", safe_serialization=True)
    (tmp / "merged_lora.json").write_text(
        json.dumps({"base": str(model), "lora": str(lora_weight_file(lora)), "scale": scale}, indent=2) + "\n"
    )
    if out.exists():
        out.rmdir()
    os.replace(tmp, out)  # the folder appears complete or not at all
    return out
