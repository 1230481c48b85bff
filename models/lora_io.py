"""LoRA handling in one place: add adapters, save only adapters (diffusers format), load back with key checks.

The saved folder is what `QwenImageEditPipeline.from_pretrained(MODEL).load_lora_weights(DIR)` expects:
`pytorch_lora_weights.safetensors` with `transformer.`-prefixed peft keys, plus the adapter's `LoraConfig` in
the safetensors metadata so diffusers rebuilds the same rank/alpha/targets (without it diffusers would
assume alpha == rank).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pipeline.config import LoraConfig
from schemas.errors import UserError

WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' default LoRA file name
ADAPTER = "default"
_PREFIX = "transformer."
_METADATA_KEY = "transformer_lora_adapter_metadata"  # how diffusers' `_save_lora_weights` stores the config


def add_lora(transformer, cfg: LoraConfig) -> None:
    """Freeze the base and attach one trainable LoRA adapter (peft) to `cfg.target_modules`."""
    from peft import LoraConfig as PeftLoraConfig

    transformer.requires_grad_(False)
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha if cfg.alpha is not None else cfg.rank,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        init_lora_weights=True if cfg.init_weights == "default" else cfg.init_weights,
    )
    transformer.add_adapter(peft_cfg, adapter_name=ADAPTER)
    # LoRA weights train in float32 even when the frozen base is bf16 (optimizer states stay exact).
    for p in lora_parameters(transformer):
        p.data = p.data.float()


def lora_parameters(transformer) -> list[torch.nn.Parameter]:
    """The trainable adapter parameters, in a stable (module) order: the optimizer's param order."""
    return [p for n, p in transformer.named_parameters() if ".lora_" in n and p.requires_grad]


def lora_state_dict(transformer, adapter_name: str = ADAPTER) -> dict[str, torch.Tensor]:
    """Adapter weights only, peft key names without the adapter name (`...to_q.lora_A.weight`).

    (diffusers' `load_lora_weights` names its adapter `default_0`: pass that to read a pipeline's LoRA.)
    """
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(transformer, adapter_name=adapter_name)


def save_lora(transformer, out_dir: str | Path) -> Path:
    """Write only the adapter, in the diffusers LoRA format; returns the weight file."""
    from diffusers import QwenImageEditPipeline

    out_dir = Path(out_dir)
    state = {k: v.detach().to("cpu").contiguous() for k, v in lora_state_dict(transformer).items()}
    QwenImageEditPipeline.save_lora_weights(
        out_dir,
        transformer_lora_layers=state,
        transformer_lora_adapter_metadata=transformer.peft_config[ADAPTER].to_dict(),
        weight_name=WEIGHT_NAME,
    )
    return out_dir / WEIGHT_NAME


def read_lora(lora_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(peft-named state dict without the `transformer.` prefix, saved adapter config or None)."""
    path = Path(lora_dir)
    path = path / WEIGHT_NAME if path.is_dir() else path
    if not path.is_file():
        raise UserError(f"no LoRA weights at {path}: expected a folder written by `pipeline run train` (RUN/lora)")
    state = load_file(path)
    with safe_open(path, framework="pt") as f:
        meta = (f.metadata() or {}).get(_METADATA_KEY)
    bad = [k for k in state if not k.startswith(_PREFIX)]
    if bad:
        raise UserError(f"{path}: keys without the '{_PREFIX}' prefix (not a diffusers transformer LoRA): {bad[:5]}")
    return {k[len(_PREFIX) :]: v for k, v in state.items()}, (json.loads(meta) if meta else None)


def load_lora(transformer, lora_dir: str | Path) -> None:
    """Copy saved adapter weights into the transformer's existing adapter; any key mismatch is an error.

    The transformer must already carry an adapter built from the same LoraConfig (`add_lora`).
    """
    from peft.utils import set_peft_model_state_dict

    path = Path(lora_dir)
    state, _ = read_lora(path)
    expected = lora_state_dict(transformer)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise UserError(
            f"LoRA at {path} does not match the adapter built from the config: "
            f"missing {missing[:5]}{'…' if len(missing) > 5 else ''} ({len(missing)}), "
            f"unexpected {unexpected[:5]}{'…' if len(unexpected) > 5 else ''} ({len(unexpected)}). "
            "Use the same train.lora settings (rank, target_modules) that wrote it."
        )
    wrong_shape = [k for k in state if state[k].shape != expected[k].shape]
    if wrong_shape:
        raise UserError(f"LoRA at {path}: shapes differ from the adapter for {wrong_shape[:5]} (different rank?)")
    result = set_peft_model_state_dict(transformer, state, adapter_name=ADAPTER)
    unexpected_after = [k for k in getattr(result, "unexpected_keys", []) if ".lora_" in k]
    if unexpected_after:
        raise UserError(f"LoRA at {path}: peft did not place keys {unexpected_after[:5]}")
