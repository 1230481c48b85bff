"""LoRA handling in one place: add an adapter, save only the adapter (diffusers format), the one loader, fusing.

The saved folder is what `QwenImageEditPipeline.from_pretrained(MODEL).load_lora_weights(DIR)` expects:
`pytorch_lora_weights.safetensors` with `transformer.`-prefixed peft keys, plus the adapter's `LoraConfig` in
the safetensors metadata (`lora_adapter_metadata`, as diffusers writes and reads it) so any reader rebuilds the
same rank/alpha/targets (without it diffusers would assume alpha == rank).

One loader: `read_lora` reads and checks the file; `load_lora` puts it into an existing adapter (resume),
`attach_lora` builds an adapter from the file's own config first (evaluate, predict, merge). diffusers'
`load_lora_weights` is the reference it is tested against, not a second code path.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from schemas.errors import UserError

WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' default LoRA file name
ADAPTER = "default"  # the trainer's adapter
_PREFIX = "transformer."
_METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY (loaders/lora_base.py)
_ADAPTER_TAGS = (".lora_", ".hada_", ".lokr_")  # peft parameter names of LoRA/DoRA, LoHa, LoKr


class LoraSettings(Protocol):
    """What `add_lora` reads (`schemas.config.LoraConfig` has exactly these fields)."""

    rank: int
    alpha: float | None
    dropout: float
    target_modules: list[str]
    init_weights: str


def adapter_config(cfg: LoraSettings):
    """The peft config of `cfg.kind` (default `lora`): LoRA, DoRA (LoRA + a learned magnitude per output),
    LoHa (Hadamard product of two low-rank pairs) or LoKr (Kronecker product) on `cfg.target_modules`."""
    from peft import LoHaConfig, LoKrConfig
    from peft import LoraConfig as PeftLoraConfig

    kind = getattr(cfg, "kind", "lora")
    alpha = cfg.alpha if cfg.alpha is not None else cfg.rank
    if kind in ("lora", "dora"):
        return PeftLoraConfig(
            r=cfg.rank, lora_alpha=alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules),
            init_lora_weights=True if cfg.init_weights == "default" else cfg.init_weights, use_dora=kind == "dora",
        )
    cls = {"loha": LoHaConfig, "lokr": LoKrConfig}[kind]
    # peft's LoHa/LoKr init (one factor zero): the adapter starts as the identity, like LoRA's B = 0.
    return cls(r=cfg.rank, alpha=alpha, module_dropout=cfg.dropout, target_modules=list(cfg.target_modules))


def add_lora(transformer, cfg: LoraSettings) -> None:
    """Freeze the base and attach one trainable adapter (peft; `cfg.kind`) to `cfg.target_modules`."""
    transformer.requires_grad_(False)
    transformer.add_adapter(adapter_config(cfg), adapter_name=ADAPTER)
    # LoRA weights train in float32 even when the frozen base is bf16 (optimizer states stay exact).
    for p in lora_parameters(transformer):
        p.data = p.data.float()


def lora_parameters(transformer) -> list[torch.nn.Parameter]:
    """The trainable adapter parameters, in a stable (module) order: the optimizer's param order."""
    return [p for n, p in transformer.named_parameters() if any(t in n for t in _ADAPTER_TAGS) and p.requires_grad]


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


# ---------------------------------------------------------------------------------------------- the loader


def lora_weight_file(lora: str | Path) -> Path:
    """RUN/lora (a folder holding WEIGHT_NAME) or the .safetensors file itself; a clear error otherwise."""
    path = Path(lora)
    path = path / WEIGHT_NAME if path.is_dir() else path
    if not path.is_file() or path.suffix != ".safetensors":
        raise UserError(
            f"no LoRA weights at {path}: pass a folder written by `pipeline run train` (RUN/lora) "
            f"holding {WEIGHT_NAME}, or the .safetensors file itself"
        )
    return path


def read_lora(lora: str | Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(peft-named state dict without the `transformer.` prefix, saved adapter config or None).

    Files in the other formats diffusers' Qwen-Image loader reads (kohya `lora_unet_*`, ComfyUI
    `diffusion_model.*`, per-module `.alpha` tensors) go through diffusers' own converter
    (`QwenImagePipeline.lora_state_dict`), which bakes each alpha / rank into the weights: config None, alpha = rank.
    """
    path = lora_weight_file(lora)
    state = load_file(path)
    with safe_open(path, framework="pt") as f:
        meta = (f.metadata() or {}).get(_METADATA_KEY)
    if any(not k.startswith(_PREFIX) or k.endswith(".alpha") for k in state):
        state, meta = _converted(path), None
    bad = [k for k in state if not k.startswith(_PREFIX)]
    if bad:
        raise UserError(f"{path}: keys without the '{_PREFIX}' prefix (not a diffusers transformer LoRA): {bad[:5]}")
    # diffusers writes the config with each key prefixed by the component (`transformer.r`, ...)
    config = {k[len(_PREFIX) :]: v for k, v in json.loads(meta).items() if k.startswith(_PREFIX)} if meta else None
    return {k[len(_PREFIX) :]: v for k, v in state.items()}, config or None


def _converted(path: Path) -> dict[str, torch.Tensor]:
    from diffusers import QwenImagePipeline

    try:
        return QwenImagePipeline.lora_state_dict(str(path))
    except (ValueError, KeyError) as e:
        raise UserError(f"{path}: not a Qwen-Image LoRA diffusers can convert ({e})") from None


def load_lora(transformer, lora: str | Path, adapter_name: str = ADAPTER, state: dict | None = None) -> None:
    """Copy saved adapter weights into the transformer's existing adapter; any key mismatch is an error.

    The transformer must already carry an adapter built from the same settings (`add_lora`, `attach_lora`).
    `state`: already read (and possibly rescaled) weights of `lora`, instead of reading the file.
    """
    from peft.utils import set_peft_model_state_dict

    state = read_lora(lora)[0] if state is None else state
    expected = lora_state_dict(transformer, adapter_name)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise UserError(
            f"LoRA at {lora} does not match the adapter built from the config: "
            f"missing {missing[:5]}{'…' if len(missing) > 5 else ''} ({len(missing)}), "
            f"unexpected {unexpected[:5]}{'…' if len(unexpected) > 5 else ''} ({len(unexpected)}). "
            "Use the same train.lora settings (rank, target_modules) that wrote it."
        )
    wrong_shape = [k for k in state if state[k].shape != expected[k].shape]
    if wrong_shape:
        raise UserError(f"LoRA at {lora}: shapes differ from the adapter for {wrong_shape[:5]} (different rank?)")
    result = set_peft_model_state_dict(transformer, state, adapter_name=adapter_name)
    unexpected_after = [k for k in getattr(result, "unexpected_keys", []) if any(t in k for t in _ADAPTER_TAGS)]
    if unexpected_after:
        raise UserError(f"LoRA at {lora}: peft did not place keys {unexpected_after[:5]}")


def init_from_lora(transformer, lora: str | Path, adapter_name: str = ADAPTER) -> None:
    """Start the trainer's adapter from an existing LoRA (`train.init_lora`): same targets and rank as the
    config (checked, one-line error naming the setting), and the same weight delta as the file: lora_B is
    rescaled by (file alpha / r) / (config alpha / r) when the alphas differ."""
    state, config = read_lora(lora)
    peft_cfg = transformer.peft_config[adapter_name]
    if getattr(peft_cfg, "peft_type", None) != "LORA" or getattr(peft_cfg, "use_dora", False):
        raise UserError(f"train.init_lora {lora}: starting from a file works for train.lora.kind 'lora' only")
    ranks = {k[: -len(".lora_A.weight")]: v.shape[0] for k, v in state.items() if k.endswith(".lora_A.weight")}
    if set(ranks.values()) - {peft_cfg.r}:
        raise UserError(f"train.init_lora {lora}: LoRA rank {sorted(set(ranks.values()))}, config "
                        f"train.lora.rank {peft_cfg.r}; set train.lora.rank to the file's rank")
    mine = {k[: -len(".lora_A.weight")] for k in lora_state_dict(transformer, adapter_name) if k.endswith(".lora_A.weight")}
    if set(ranks) != mine:
        raise UserError(f"train.init_lora {lora}: the file adapts {len(ranks)} modules, train.lora.target_modules "
                        f"{len(mine)} (e.g. only in the file: {sorted(set(ranks) - mine)[:3]}, only in the config: "
                        f"{sorted(mine - set(ranks))[:3]}); set train.lora.target_modules to the file's modules")
    file_alpha = (config or {}).get("lora_alpha", peft_cfg.r)
    factor = float(file_alpha) / float(peft_cfg.lora_alpha)
    if factor != 1.0:
        state = {k: v * factor if k.endswith(".lora_B.weight") else v for k, v in state.items()}
    load_lora(transformer, lora, adapter_name, state={k: v.float() for k, v in state.items()})


def attach_lora(transformer, lora: str | Path, scale: float = 1.0, adapter_name: str = "lora") -> None:
    """Build an adapter from the LoRA file's own config (rank, alpha, targets), load its weights, activate it at
    `scale`. A file without the config (written elsewhere) gets rank and targets from its shapes, alpha = rank
    (what diffusers assumes too)."""
    state, config = read_lora(lora)
    transformer.add_adapter(_peft_config(state, config), adapter_name=adapter_name)
    # peft builds adapter weights in the layers' dtype: load the saved values into exactly those.
    load_lora(transformer, lora, adapter_name)
    transformer.set_adapters([adapter_name], weights=[scale])


def _peft_config(state: dict[str, torch.Tensor], saved: dict | None):
    from peft import LoHaConfig, LoKrConfig
    from peft import LoraConfig as PeftLoraConfig

    if saved:
        cls = {"LOHA": LoHaConfig, "LOKR": LoKrConfig}.get(saved.get("peft_type"), PeftLoraConfig)
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        return cls(**{k: v for k, v in saved.items() if k in known})
    ranks = {k[: -len(".lora_A.weight")]: v.shape[0] for k, v in state.items() if k.endswith(".lora_A.weight")}
    if not ranks:
        raise UserError("the LoRA file holds no lora_A weights")
    rank = max(set(ranks.values()), key=list(ranks.values()).count)
    return PeftLoraConfig(
        r=rank, lora_alpha=rank, target_modules=sorted(ranks),
        rank_pattern={m: r for m, r in ranks.items() if r != rank}, alpha_pattern={m: r for m, r in ranks.items() if r != rank},
    )


# ---------------------------------------------------------------------------------------------- merging


def saved_dtype(model: str) -> torch.dtype:
    """Dtype of the model's stored transformer weights (merge writes back what it read)."""
    from models.loading import resolve_model

    folder = resolve_model(model) / "transformer"
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                name = st.get_slice(key).get_dtype()
                return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(name, torch.float32)
    return torch.float32


def fused_transformer(model: str, lora: str | Path, scale: float = 1.0, dtype: torch.dtype | None = None):
    """MODEL's transformer with W + scale·(B·A)·alpha/r fused into its weights and the LoRA layers removed."""
    from models.loading import load_component

    transformer = load_component(model, "transformer", dtype=dtype or saved_dtype(model))
    attach_lora(transformer, lora, scale=1.0, adapter_name="lora")
    transformer.fuse_lora(lora_scale=scale, adapter_names=["lora"])
    transformer.unload_lora()  # drops the peft layers, keeps the fused base weights
    return transformer
