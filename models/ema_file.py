"""A checkpoint's EMA of the adapter (`train.ema_decay`): `RUN/checkpoints/step-N/ema.safetensors`, float32 tensors
named "0".."n-1" in the trainer's parameter order (`models.lora.lora_parameters`: module order). Written and read
back by the trainer (`stages.train.ema.AdapterEMA`); evaluate --all-checkpoints scores it as a LoRA: the step's
`lora/` gives the adapter (rank, alpha, targets) and the key of each tensor (`ema_state`).

It is no LoRA file by itself (no key names, no config): `pipeline predict` / `lora merge` take `RUN/lora_ema`, or
the best EMA checkpoint evaluate writes as a LoRA (docs/evaluate.md)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load as load_bytes, save_file

from schemas.errors import UserError

EMA_FILE = "ema.safetensors"
LORA_EMA = "lora_ema"  # RUN/lora_ema: the final EMA as a LoRA (stages/train/saving.py)


def save_values(values: list[torch.Tensor], folder: Path) -> None:
    save_file({str(i): v.contiguous().cpu() for i, v in enumerate(values)}, Path(folder) / EMA_FILE)


def read_values(data: bytes) -> list[torch.Tensor]:
    """The tensors of an EMA file's bytes, in the trainer's parameter order."""
    saved = load_bytes(data)
    return [saved[str(i)] for i in range(len(saved))]


def ema_of(lora: str | Path) -> Path:
    """The EMA file beside a checkpoint's LoRA folder (RUN/checkpoints/step-N/lora -> step-N/ema.safetensors)."""
    return Path(lora).parent / EMA_FILE


def is_ema_file(path: str | Path) -> bool:
    return Path(path).name == EMA_FILE


def ema_state(transformer, adapter_name: str, data: bytes, path: Path) -> dict[str, torch.Tensor]:
    """The EMA file's bytes (`data`, of `path`) as a state dict of the transformer's adapter `adapter_name` (built
    from the step's `lora/`): its keys in module order, the order the trainer saved the tensors in."""
    from models.lora import lora_state_dict

    values = read_values(data)
    expected = lora_state_dict(transformer, adapter_name)
    if len(values) != len(expected) or any(v.shape != e.shape for v, e in zip(values, expected.values())):
        raise UserError(f"{path}: an EMA of {len(values)} tensors that does not fit the adapter of its checkpoint's "
                        f"lora/ ({len(expected)} tensors): not written by the training that wrote that LoRA")
    return dict(zip(expected, values))
